-- HAProxy actions over the JSON of an HTTP request body (haproxy.cfg loads this file and calls them
-- on /infer and /generate routes, once the body has arrived). Why by hand: HAProxy has no JSON
-- validation of its own, and no Lua JSON library is this strict (duplicate keys, numbers past a
-- double, shapes against the data that carries them).
--
-- tritonserver 2.51 answers a body whose JSON is malformed or wrongly typed with a 500, sizes a
-- JSON input from its declared "shape" before it reads "data" (a 100-byte body can ask for all
-- the host's memory), and its JSON parser recurses once per nesting level. So the proxy parses the
-- JSON itself, strictly (RFC 8259: one value, no duplicate keys, valid UTF-8, `\u` escapes decoded),
-- and checks the shape of the request the server will read: a client error is a 400 naming the
-- problem before any byte reaches the server. A tensor's declared shape must fit what carries
-- its values: its "data", the binary part of the body, or the shared-memory region it names.
-- Each action sets txn.json_error to a message for the client; the config refuses the request
-- when it is set, and when the check itself fails (a refusal, never a request passed unchecked).

local MAX_DEPTH = 32
local OBJECT = {} -- metatable of decoded objects
local ARRAY = {} -- metatable of decoded arrays (their length in field n)
local ESCAPES = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
-- Integer ranges of the integer datatypes; UINT64's top is checked on the digits.
local INT_RANGES = {
  INT8 = { -128, 127 }, INT16 = { -32768, 32767 }, INT32 = { -2147483648, 2147483647 },
  INT64 = { math.mininteger, math.maxinteger },
  UINT8 = { 0, 255 }, UINT16 = { 0, 65535 }, UINT32 = { 0, 4294967295 }, UINT64 = { 0, math.maxinteger },
}
local FLOAT_TYPES = { FP16 = true, BF16 = true, FP32 = true, FP64 = true }
local UINT64_MAX = "18446744073709551615"
local BIG = {} -- metatable of integer literals past int64: { raw = digits }

local function fail(message)
  error({ json = message }, 0)
end

-- The JSON value of `text` (the whole of it), or raises {json = message}.
local function parse(text)
  local pos, len = 1, #text

  local function bad(what)
    fail(string.format("the request body is not valid JSON: %s at byte %d", what, pos - 1))
  end

  local function skip_space()
    pos = text:find("[^ \t\r\n]", pos) or len + 1
  end

  local function parse_string()
    pos = pos + 1
    local parts, n = {}, 0
    while true do
      local at = text:find('[%z\1-\31"\\]', pos)
      if not at then
        pos = len + 1
        bad("unterminated string")
      end
      n = n + 1
      parts[n] = text:sub(pos, at - 1)
      local c = text:byte(at)
      if c == 34 then
        pos = at + 1
        break
      elseif c ~= 92 then
        pos = at
        bad("control character in a string")
      end
      local escape = text:sub(at + 1, at + 1)
      if escape == "u" then
        local hex = text:match("^%x%x%x%x", at + 2)
        if not hex then
          pos = at
          bad("bad \\u escape")
        end
        local code, after = tonumber(hex, 16), at + 6
        if code >= 0xD800 and code <= 0xDBFF then
          local low = text:match("^\\u(%x%x%x%x)", after)
          low = low and tonumber(low, 16)
          if not low or low < 0xDC00 or low > 0xDFFF then
            pos = at
            bad("unpaired surrogate in a \\u escape")
          end
          code, after = 0x10000 + (code - 0xD800) * 0x400 + (low - 0xDC00), after + 6
        elseif code >= 0xDC00 and code <= 0xDFFF then
          pos = at
          bad("unpaired surrogate in a \\u escape")
        end
        n = n + 1
        parts[n] = utf8.char(code)
        pos = after
      elseif ESCAPES[escape] then
        n = n + 1
        parts[n] = ESCAPES[escape]
        pos = at + 2
      else
        pos = at
        bad("bad escape")
      end
    end
    local value = table.concat(parts)
    if not utf8.len(value) then
      bad("a string is not valid UTF-8")
    end
    return value
  end

  local function parse_number()
    local start, p = pos, pos
    if text:byte(p) == 45 then
      p = p + 1
    end
    local c = text:byte(p)
    if c == 48 then
      p = p + 1
    elseif c and c >= 49 and c <= 57 then
      p = text:find("[^%d]", p) or len + 1
    else
      bad("bad number")
    end
    local integral = true
    if text:byte(p) == 46 then
      local stop = text:find("[^%d]", p + 1) or len + 1
      if stop == p + 1 then
        pos = p
        bad("bad number")
      end
      p, integral = stop, false
    end
    c = text:byte(p)
    if c == 101 or c == 69 then
      p = p + 1
      c = text:byte(p)
      if c == 43 or c == 45 then
        p = p + 1
      end
      local stop = text:find("[^%d]", p) or len + 1
      if stop == p then
        pos = p
        bad("bad number")
      end
      p, integral = stop, false
    end
    local raw = text:sub(start, p - 1)
    local number = tonumber(raw)
    if number == math.huge or number == -math.huge then -- tritonserver's parser refuses it with a 500
      pos = start -- the message names where it begins
      bad("a number too large for a double")
    end
    pos = p
    if integral then
      local value = math.tointeger(number)
      if value ~= nil and tostring(value) == raw:gsub("^%-0$", "0") then
        return value
      end
      return setmetatable({ raw = raw }, BIG)
    end
    return number + 0.0
  end

  local parse_value

  local function parse_container(depth, closer)
    if depth > MAX_DEPTH then
      fail("the request JSON nests more than " .. MAX_DEPTH .. " levels deep")
    end
    local is_object = closer == 125
    local result, n = setmetatable({}, is_object and OBJECT or ARRAY), 0
    pos = pos + 1
    skip_space()
    if text:byte(pos) == closer then
      pos = pos + 1
      if not is_object then
        result.n = 0
      end
      return result
    end
    while true do
      if is_object then
        skip_space()
        if text:byte(pos) ~= 34 then
          bad("expected a string key")
        end
        local key = parse_string()
        if rawget(result, key) ~= nil then
          bad(string.format("duplicate key %q", key))
        end
        skip_space()
        if text:byte(pos) ~= 58 then
          bad("expected ':'")
        end
        pos = pos + 1
        result[key] = parse_value(depth)
      else
        n = n + 1
        result[n] = parse_value(depth)
      end
      skip_space()
      local c = text:byte(pos)
      pos = pos + 1
      if c == closer then
        break
      elseif c ~= 44 then
        pos = pos - 1
        bad(is_object and "expected ',' or '}'" or "expected ',' or ']'")
      end
    end
    if not is_object then
      result.n = n
    end
    return result
  end

  local LITERALS = { t = { "true", true }, f = { "false", false }, n = { "null", OBJECT } }

  parse_value = function(depth)
    skip_space()
    local c = text:byte(pos)
    if c == 123 then
      return parse_container(depth + 1, 125)
    elseif c == 91 then
      return parse_container(depth + 1, 93)
    elseif c == 34 then
      return parse_string()
    elseif c == 45 or (c and c >= 48 and c <= 57) then
      return parse_number()
    end
    local literal = c and LITERALS[string.char(c)]
    if literal and text:sub(pos, pos + #literal[1] - 1) == literal[1] then
      pos = pos + #literal[1]
      return literal[2] -- null decodes as the OBJECT marker itself: no field accepts it
    end
    if pos > len then
      bad("unexpected end of the body")
    end
    bad("unexpected character")
  end

  local value = parse_value(0)
  skip_space()
  if pos <= len then
    bad("more than one value")
  end
  return value
end

local function is_object(value)
  return type(value) == "table" and getmetatable(value) == OBJECT
end

local function is_array(value)
  return type(value) == "table" and getmetatable(value) == ARRAY
end

local function is_count(value)
  return math.type(value) == "integer" and value >= 0
end

local function is_scalar(value)
  local kind = type(value)
  return kind == "string" or kind == "number" or kind == "boolean" or getmetatable(value) == BIG
end

-- Whether `value` may be an element of a tensor of `datatype`.
local function fits(value, datatype)
  if datatype == "BOOL" then
    return type(value) == "boolean"
  elseif datatype == "BYTES" then
    return type(value) == "string"
  elseif FLOAT_TYPES[datatype] then
    return type(value) == "number" or getmetatable(value) == BIG
  end
  local range = INT_RANGES[datatype]
  if math.type(value) == "integer" then
    return value >= range[1] and value <= range[2]
  end
  if datatype == "UINT64" and getmetatable(value) == BIG then
    local raw = value.raw
    return raw:match("^%d+$") ~= nil and (#raw < #UINT64_MAX or (#raw == #UINT64_MAX and raw <= UINT64_MAX))
  end
  return false
end

local function where(name)
  return string.format("input '%s'", name)
end

-- The scalars of `data` (flat, or nested exactly as `shape`), each checked against `datatype`.
local function data_count(data, shape, datatype, name)
  if data.n > 0 and is_array(data[1]) then
    local function walk(node, level)
      if not is_array(node) or node.n ~= shape[level] then
        fail(string.format("%s: 'data' nests differently from its shape", where(name)))
      end
      for i = 1, node.n do
        if level < #shape then
          walk(node[i], level + 1)
        elseif not fits(node[i], datatype) then
          fail(string.format("%s: 'data' holds a value that is not %s", where(name), datatype))
        end
      end
    end
    walk(data, 1)
    local count = 1.0
    for i = 1, #shape do
      count = count * shape[i]
    end
    return count
  end
  for i = 1, data.n do
    if not fits(data[i], datatype) then
      fail(string.format("%s: 'data' holds a value that is not %s", where(name), datatype))
    end
  end
  return data.n
end

-- The parameters tritonserver's HTTP frontend reads with a type, by what they must be: any other
-- value is its 500 (for a parameter of an output it does not have, too).
local UINT, ID = "a non-negative integer", "a string or a non-negative integer"
local KINDS = {
  ["a boolean"] = function(value) return type(value) == "boolean" end,
  ["a string"] = function(value) return type(value) == "string" end,
  [UINT] = function(value) return fits(value, "UINT64") end,
  [ID] = function(value) return type(value) == "string" or fits(value, "UINT64") end,
}
local REQUEST_PARAMETERS = {
  binary_data_output = "a boolean", sequence_start = "a boolean", sequence_end = "a boolean",
  priority = UINT, timeout = UINT, sequence_id = ID,
}
local SHARED_MEMORY = { shared_memory_region = "a string", shared_memory_byte_size = UINT, shared_memory_offset = UINT }
local INPUT_PARAMETERS = setmetatable({ binary_data_size = UINT }, { __index = SHARED_MEMORY })
local OUTPUT_PARAMETERS = setmetatable({ binary_data = "a boolean", classification = UINT }, { __index = SHARED_MEMORY })

-- The parameters only the front door may set: the client's address, which the models read as a
-- request parameter (the door sets it as a gRPC header; tritonserver forwards none on HTTP).
local RESERVED = { ["triton-client-address"] = true }

-- `parameters`: an object of scalars, each of `kinds` (name -> what it must be) of that kind.
local function check_parameters(parameters, owner, kinds)
  if parameters == nil then
    return
  end
  if not is_object(parameters) then
    fail(owner .. ": 'parameters' must be an object")
  end
  for key, value in pairs(parameters) do
    if key:find("\0", 1, true) then -- tritonserver reads the name up to it, finds no such key: a 500
      fail(owner .. ": a parameter's name may not hold a NUL character")
    end
    if RESERVED[key] then
      fail(string.format("%s: parameter '%s' is the front door's to set", owner, key))
    end
    if not is_scalar(value) then
      fail(string.format("%s: parameter '%s' must be a string, number or boolean", owner, key))
    end
    local kind = kinds and kinds[key]
    if kind and not KINDS[kind](value) then
      fail(string.format("%s: parameter '%s' must be %s", owner, key, kind))
    end
  end
end

local function only_keys(object, allowed, owner)
  for key in pairs(object) do
    if not allowed[key] then
      fail(string.format("%s: unknown field '%s'", owner, key))
    end
  end
end

local REQUEST_KEYS = { id = true, parameters = true, inputs = true, outputs = true }
local INPUT_KEYS = { name = true, shape = true, datatype = true, parameters = true, data = true }
local OUTPUT_KEYS = { name = true, parameters = true }
local DATATYPES = { BOOL = true, BYTES = true }
for name in pairs(INT_RANGES) do
  DATATYPES[name] = true
end
for name in pairs(FLOAT_TYPES) do
  DATATYPES[name] = true
end

-- A KServe v2 inference request whose binary part (after the JSON) holds `binary_bytes`.
local function check_infer(request, binary_bytes)
  if not is_object(request) then
    fail("the request body must be a JSON object")
  end
  only_keys(request, REQUEST_KEYS, "the request")
  if request.id ~= nil and type(request.id) ~= "string" then
    fail("'id' must be a string")
  end
  check_parameters(request.parameters, "the request", REQUEST_PARAMETERS)
  local inputs = request.inputs
  if not is_array(inputs) or inputs.n == 0 then
    fail("'inputs' must be a non-empty list of tensors")
  end
  for i = 1, inputs.n do
    local input = inputs[i]
    if not is_object(input) then
      fail("each of 'inputs' must be an object")
    end
    local name = input.name
    if type(name) ~= "string" or name == "" then
      fail("each of 'inputs' needs a 'name' (a string)")
    end
    only_keys(input, INPUT_KEYS, where(name))
    if type(input.datatype) ~= "string" or not DATATYPES[input.datatype] then
      fail(where(name) .. ": 'datatype' must be one of the KServe v2 datatypes (BOOL, INT32, FP32, ...)")
    end
    local shape = input.shape
    if not is_array(shape) then
      fail(where(name) .. ": 'shape' must be a list of non-negative integers")
    end
    local elements = 1.0 -- a float: a product of huge dims must not wrap around
    for d = 1, shape.n do
      if not is_count(shape[d]) then
        fail(where(name) .. ": 'shape' must be a list of non-negative integers")
      end
      elements = elements * shape[d]
    end
    shape.n = nil
    check_parameters(input.parameters, where(name), INPUT_PARAMETERS)
    local parameters = input.parameters or {}
    local region, binary = parameters.shared_memory_region, parameters.binary_data_size
    if region ~= nil or binary ~= nil then
      if input.data ~= nil then
        fail(where(name) .. ": 'data' cannot go with shared memory or binary data")
      end
      local bytes, source
      if region ~= nil then
        if type(region) ~= "string" or not is_count(parameters.shared_memory_byte_size) then
          fail(where(name) .. ": shared memory needs 'shared_memory_region' and 'shared_memory_byte_size'")
        end
        bytes, source = parameters.shared_memory_byte_size, "its shared-memory byte size"
      else
        if not is_count(binary) then
          fail(where(name) .. ": 'binary_data_size' must be a non-negative integer")
        end
        bytes, source = math.min(binary, binary_bytes), "the binary part of the body"
      end
      if elements > bytes then
        fail(string.format("%s: its shape declares %.0f elements, more than %s holds", where(name), elements, source))
      end
    else
      if not is_array(input.data) then
        fail(where(name) .. ": 'data' (a list) is needed without shared memory or binary data")
      end
      local count = data_count(input.data, shape, input.datatype, name)
      if count ~= elements then
        fail(string.format("%s: 'data' holds %d values, its shape declares %.0f", where(name), count, elements))
      end
    end
  end
  local outputs = request.outputs
  if outputs ~= nil then
    if not is_array(outputs) then
      fail("'outputs' must be a list")
    end
    for i = 1, outputs.n do
      local output = outputs[i]
      if not is_object(output) or type(output.name) ~= "string" then
        fail("each of 'outputs' must be an object with a 'name' (a string)")
      end
      only_keys(output, OUTPUT_KEYS, string.format("output '%s'", output.name))
      check_parameters(output.parameters, string.format("output '%s'", output.name), OUTPUT_PARAMETERS)
    end
  end
end

-- The generate extension's body: each model input by name, a scalar or a flat list of its type.
-- `spec` is "name:DATATYPE ..." from the model's config (the proxy's config passes it).
local function check_generate(request, spec, streaming)
  if not is_object(request) then
    fail("the request body must be a JSON object")
  end
  local inputs = {}
  for name, datatype in spec:gmatch("([^%s:]+):(%u+%d*)") do
    inputs[name] = datatype
  end
  for key, value in pairs(request) do
    local datatype = inputs[key]
    if key == "parameters" then
      check_parameters(value, "the request")
    elseif key == "id" then
      if type(value) ~= "string" then
        fail("'id' must be a string")
      end
    elseif datatype == nil then
      local names = {}
      for name in spec:gmatch("([^%s:]+):") do
        names[#names + 1] = name
      end
      fail(string.format("unknown field '%s': the model's inputs are %s", key, table.concat(names, ", ")))
    elseif is_array(value) then
      for i = 1, value.n do
        if not fits(value[i], datatype) then
          fail(string.format("%s must hold values of type %s", where(key), datatype))
        end
      end
    elseif not fits(value, datatype) then
      fail(string.format("%s must be of type %s (or a list of them)", where(key), datatype))
    end
  end
  if request.stream == true and not streaming then
    fail("'stream': true streams one response per token: send it to generate_stream, not generate")
  end
end

-- Runs `check` on the request body; any failure, even of the check itself, refuses the request.
local function guarded(txn, check)
  local ok, err = pcall(check)
  if not ok then
    if type(err) == "table" and err.json then
      txn:set_var("txn.json_error", err.json)
    else
      txn:Warning("json_checks: " .. tostring(err))
      txn:set_var("txn.json_error", "the proxy could not check this request body")
    end
  end
end

core.register_action("check_infer_json", { "http-req" }, function(txn)
  guarded(txn, function()
    local body = txn.f:req_body() or ""
    local json_bytes = tonumber(txn:get_var("txn.json_bytes") or "") or #body
    if json_bytes > #body then
      fail("the JSON part of the body did not arrive whole")
    end
    local body_bytes = tonumber(txn.f:req_body_size()) or #body -- declared: the buffer may hold less
    check_infer(parse(body:sub(1, json_bytes)), body_bytes - json_bytes)
  end)
end, 0)

-- The model's inputs and the route come from the proxy's variables (the model's line of
-- input_specs.map, and generate or generate_stream).
core.register_action("check_generate_json", { "http-req" }, function(txn)
  local spec, route = txn:get_var("txn.input_spec") or "", txn:get_var("txn.json_route")
  guarded(txn, function()
    local body = txn.f:req_body() or ""
    if #body < (tonumber(txn.f:req_body_size()) or 0) then
      fail("the body did not arrive whole")
    end
    check_generate(parse(body), spec, route == "generate_stream")
  end)
end, 0)
