-- HAProxy actions over the JSON part of an HTTP request body (plugin/ops/proxy_config.py loads this
-- file and calls them on /infer and /generate routes, once the body's first buffer has arrived).
--
-- tritonserver 2.51 sizes a JSON input from its declared "shape" before it reads "data", and its
-- JSON parser recurses once per nesting level: a 100-byte body can take all the host's memory or
-- overflow the server's stack. Any tensor a legitimate body carries has at most as many elements
-- as the body has bytes (an element takes at least one byte, as JSON text or binary), and no
-- tensor nests deeper than a few levels, so the checks need no knowledge of the models.
-- Both set txn.json_error to a message for the client; the config denies the request when set.

local MAX_DEPTH = 32

-- The deepest nesting of arrays and objects outside strings, stopping once it passes MAX_DEPTH.
local function nesting_depth(text)
  local depth, deepest, in_string, escaped = 0, 0, false, false
  for i = 1, #text do
    local c = text:byte(i)
    if in_string then
      if escaped then
        escaped = false
      elseif c == 92 then -- backslash
        escaped = true
      elseif c == 34 then -- quote
        in_string = false
      end
    elseif c == 34 then
      in_string = true
    elseif c == 91 or c == 123 then -- [ {
      depth = depth + 1
      if depth > deepest then
        deepest = depth
        if deepest > MAX_DEPTH then
          return deepest
        end
      end
    elseif c == 93 or c == 125 then -- ] }
      depth = depth - 1
    end
  end
  return deepest
end

-- Why the shapes the JSON text declares cannot be honest for a body of `body_bytes`, or nil.
local function shape_error(text, body_bytes)
  for shape in text:gmatch('"shape"%s*:%s*(%b[])') do
    local dims = shape:sub(2, -2)
    if dims:find("[^%d%s,]") then
      return "a tensor's shape must be a list of non-negative integers"
    end
    local elements = 1
    for dim in dims:gmatch("%d+") do
      elements = elements * tonumber(dim) -- a float past 2^53: still far above any body size
    end
    if elements > body_bytes then
      return string.format("a tensor's shape declares %.0f elements, more than the request body holds", elements)
    end
  end
  return nil
end

local function check(txn, with_shapes)
  local text = txn.f:req_body() or ""
  local json_bytes = tonumber(txn:get_var("txn.json_bytes") or "")
  if json_bytes ~= nil and json_bytes < #text then
    text = text:sub(1, json_bytes) -- the JSON header of a binary-tensor body
  end
  if text:find("\\u", 1, true) then
    -- an escaped key ("\u0073hape") would slip past the textual checks below
    txn:set_var("txn.json_error", "\\u escapes are not accepted in request JSON")
  elseif nesting_depth(text) > MAX_DEPTH then
    txn:set_var("txn.json_error", "the request JSON nests more than " .. MAX_DEPTH .. " levels deep")
  elseif with_shapes then
    local why = shape_error(text, tonumber(txn.f:req_body_size()) or #text)
    if why ~= nil then
      txn:set_var("txn.json_error", why)
    end
  end
end

core.register_action("check_infer_json", { "http-req" }, function(txn)
  check(txn, true)
end, 0)

core.register_action("check_generate_json", { "http-req" }, function(txn)
  check(txn, false)
end, 0)
