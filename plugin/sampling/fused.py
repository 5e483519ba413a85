"""Fused Triton fast path for rows with a finite top_k (at most 1024): the sampler's semantics in
one top-k selection and two kernels, with no device-to-host synchronisation.

Per call: one host-to-device copy of the packed parameters (skipped when they already live on the
logits' device), `torch.topk` of F = selection.candidate_count(k_max, V) candidates, one
`torch.empty` for the packed output, then

* kernel A (`_row_stats_kernel`, one program per row): one pass over the row for row_max with
  `amax`'s semantics (NaN if any NaN, +inf if any +inf, -inf if all -inf) and the normaliser
  z = sum exp((x - max) / T), both fp32 (the shift is the top-k maximum, which is the row
  max on every valid row, so no online rescaling is needed); and, only where a run of equal logits at the
  row's top-k boundary reaches past the fetched set, the boundary tie repair (those places go to
  the lowest tied ids, ascending);
* kernel B (`_select_kernel`, one program per row): the candidates ranked by the total order
  (logit desc, lower id first) with one sort of a composite int64 key, then the prefix rules of
  the epilogues (top_k, -inf, top_p, min_p), a Gumbel-max draw whose noise is
  `rng.gumbel(rng.seed_state(seed), id)` recomputed in the kernel with the same wrapping int64
  arithmetic, and the packed outputs.

Everything is fp32 but the two boundary rules' comparisons, which kernel B makes in float64 per
candidate so that they decide as the other paths do (see `epilogues`): top_p on the fp32 prefix
sums of p / p_max against top_p * z, min_p on x - max against the host's `params.min_p_bound`.
bf16/fp16 logits are ranked by the values as sent. The kernels address the packed parameters and
outputs through the column constants below, passed to them as `tl.constexpr` arguments;
`launches` gives every compile-time choice a call makes (the ahead-of-time compile test builds
the same). Under `TRITON_INTERPRET=1` (set before this module is
imported) the kernels run on CPU tensors. The module imports without triton, or with one older than
`MIN_TRITON`: `AVAILABLE` is then False and `sample_packed` raises.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from . import outputs, rng
from .params import RowParams, min_p_bound
from .results import ROW_MAX, HostResult
from .selection import candidate_count

# The oldest Triton the kernels are checked with: its interpreter runs the unit tests and its compiler
# builds every kernel for each GPU of tests/test_kernel_compile.py. Triton 3.1 (torch 2.5.1's, the 2.51
# image line's) fails them in its interpreter. With an older Triton, or none, the fused path is off and
# the plain-torch GPU ops serve every row, with the same outputs.
MIN_TRITON = (3, 4)


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.6.0" or "3.4.0+git1234"."""
    major, minor = ([int(part) for part in re.findall(r"\d+", version)[:2]] + [0, 0])[:2]
    return major, minor


try:
    import triton
    import triton.language as tl

    TRITON_VERSION = triton.__version__
except ImportError:
    triton = None
    tl = None
    TRITON_VERSION = None
AVAILABLE = TRITON_VERSION is not None and version_tuple(TRITON_VERSION) >= MIN_TRITON
_UNAVAILABLE = f"sampling.fused needs triton >= {'.'.join(map(str, MIN_TRITON))}, " + (
    f"found {TRITON_VERSION}" if TRITON_VERSION else "which is not installed"
)

# The packed output: int32 [R, PACKED_COLUMNS + 2 W] (then the W mask ids and their W log-probs).
# Floats travel as their float32 bit patterns, so one int32 tensor (one device-to-host copy)
# carries every per-row output.
PACKED_COLUMNS = 6
COL_TOKEN_ID, COL_LOGPROB, COL_MASK_LEN, COL_MASK_LOGPROB, COL_ROW_MAX, COL_Z = range(PACKED_COLUMNS)

# The packed parameters: int64 [R, PARAM_COLUMNS]; float32 values as their int32 bit patterns, the
# min_p bound (float64) as its int64 bit pattern.
PARAM_COLUMNS = 6
PARAM_TEMPERATURE, PARAM_K_EFF, PARAM_TOP_P, PARAM_MIN_P_BOUND, PARAM_SEED, PARAM_WANT_MASK = range(PARAM_COLUMNS)

MAX_TOP_K = 1024  # rows above this take the sampler's full-sort path
_BLOCK_V = 4096  # logits per step of kernel A's pass over the row
_MIN_BLOCK = 16  # smallest block kernel B sorts (tl.arange and tl.sort want a few lanes)

# Triton launches per sample_packed call, for tests that count the work of one call.
LAUNCHES = 0


def pack_params(params: RowParams, k_eff: np.ndarray) -> np.ndarray:
    """Per-row parameters as the kernels read them: int64 [R, PARAM_COLUMNS], built on the host.

    `params` are the rows' as the sampler applies them (greedy applied: `RowPlan.params`) and
    `k_eff` their effective top_k (`RowPlan.k_eff`). Temperature and top_p are stored as their
    float32 bit patterns, min_p as the float64 bit pattern of its bound (`params.min_p_bound`) and
    seeds as the int64 bit patterns of the uint64 seeds.
    """
    packed = np.empty((params.rows, PARAM_COLUMNS), dtype=np.int64)
    packed[:, PARAM_TEMPERATURE] = np.ascontiguousarray(params.temperature, np.float32).view(np.int32)
    packed[:, PARAM_K_EFF] = k_eff
    packed[:, PARAM_TOP_P] = np.ascontiguousarray(params.top_p, np.float32).view(np.int32)
    packed[:, PARAM_MIN_P_BOUND] = min_p_bound(params).view(np.int64)
    packed[:, PARAM_SEED] = params.seed.view(np.int64)
    packed[:, PARAM_WANT_MASK] = params.return_sampling_mask
    return packed


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _launch(kernel, grid, *args, **kwargs) -> None:
    """Launch one Triton kernel; the single place launches happen, so tests can count them."""
    global LAUNCHES
    LAUNCHES += 1
    kernel[grid](*args, **kwargs)


def sample_packed(logits: torch.Tensor, params: torch.Tensor, k_max: int, mask_width: int) -> torch.Tensor:
    """Sample every row of `logits` [R, V] (float32, bfloat16 or float16) on its own device.

    `params` is `pack_params`' int64 [R, PARAM_COLUMNS] as a host tensor (pin it for a truly
    asynchronous copy), `k_max` the largest effective top_k in it (1..1024), `mask_width` the mask
    width W. Returns int32 [R, PACKED_COLUMNS + 2W] on the logits' device: the COL_* columns (floats
    as float32 bits), the mask ids padded with -1, then each mask id's renormalised log-probability
    (-inf padded; see `unpack`).
    No device-to-host synchronisation; at most 3 torch ops and 2 kernel launches.
    """
    if not AVAILABLE:
        raise RuntimeError(_UNAVAILABLE)
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"logits must be [rows, vocab] float32/bfloat16/float16, got {tuple(logits.shape)} {logits.dtype}"
        )
    rows, vocab = logits.shape
    if vocab < 1 or vocab >= 1 << 31:
        raise ValueError(f"vocabulary size {vocab} is outside [1, 2**31)")
    if params.dtype != torch.int64 or tuple(params.shape) != (rows, PARAM_COLUMNS):
        raise ValueError(f"params must be int64 [{rows}, {PARAM_COLUMNS}], got {tuple(params.shape)} {params.dtype}")
    if not 1 <= k_max <= MAX_TOP_K:
        raise ValueError(f"k_max must be in [1, {MAX_TOP_K}], got {k_max}")
    if mask_width < 0:
        raise ValueError(f"mask_width must be >= 0, got {mask_width}")
    if logits.stride(1) != 1:  # the kernels step through a row with unit stride
        logits = logits.contiguous()
    device = logits.device
    if params.device != device:  # already there on CPU: no copy, no op
        params = params.to(device, non_blocking=True)
    params = params.contiguous()
    fetched = candidate_count(k_max, vocab)
    values, ids = torch.topk(logits, fetched, dim=-1, largest=True, sorted=True)
    # Columns COL_ROW_MAX and COL_Z double as kernel A's output: no other allocation.
    packed = torch.empty(rows, PACKED_COLUMNS + 2 * mask_width, dtype=torch.int32, device=device)
    if rows == 0:
        return packed
    for kernel, args, keywords in launches(logits, params, values, ids, packed, mask_width):
        _launch(kernel, (rows,), *args, **keywords)
    return packed


def block_sizes(vocab: int, fetched: int) -> dict[str, int]:
    """The kernels' block sizes for a call on V = `vocab` that fetched F = `fetched` candidates per
    row (`selection.candidate_count` of its largest top_k): BLOCK_V, kernel A's step over the row,
    and BLOCK_F, the candidates padded to a power of two (LOG_F its log2). Nothing else varies
    between calls at compile time (the mask width is a runtime argument)."""
    block_v = min(_BLOCK_V, max(_MIN_BLOCK, _next_power_of_two(vocab)))
    block_f = max(_MIN_BLOCK, _next_power_of_two(fetched))
    # Kernel A's tie repair reads the F candidates in one BLOCK_V block: F <= V, and F <= 1296 < 4096.
    if fetched > block_v:
        raise ValueError(f"{fetched} candidates do not fit one block of {block_v}")
    return dict(BLOCK_V=block_v, BLOCK_F=block_f, LOG_F=block_f.bit_length() - 1)


def launches(logits, params, values, ids, packed, mask_width: int) -> list[tuple[object, tuple, dict]]:
    """A call's two kernel launches as (kernel, arguments, keywords): the keywords are every
    compile-time choice (block sizes, column constants, warps, options), so the ahead-of-time
    compile test builds exactly what a call would. The arguments are those of `sample_packed`,
    with `values` and `ids` the fetched candidates [R, F] and `packed` the output."""
    vocab, fetched = logits.shape[1], values.shape[1]
    blocks = block_sizes(vocab, fetched)
    columns = dict(PARAM_COLUMNS=PARAM_COLUMNS, PARAM_TEMPERATURE=PARAM_TEMPERATURE, PARAM_K_EFF=PARAM_K_EFF)
    row_stats = (
        _row_stats_kernel,
        (logits, logits.stride(0), vocab, params, values, ids, fetched, packed, packed.stride(0)),
        dict(
            BLOCK_V=blocks["BLOCK_V"],
            **columns,
            COL_ROW_MAX=COL_ROW_MAX,
            COL_Z=COL_Z,
            num_warps=8,
            enable_fp_fusion=False,
        ),
    )
    select = (
        _select_kernel,
        (values, ids, fetched, params, packed, packed.stride(0), mask_width),
        dict(
            BLOCK_F=blocks["BLOCK_F"],
            LOG_F=blocks["LOG_F"],
            **columns,
            PARAM_TOP_P=PARAM_TOP_P,
            PARAM_MIN_P_BOUND=PARAM_MIN_P_BOUND,
            PARAM_SEED=PARAM_SEED,
            PARAM_WANT_MASK=PARAM_WANT_MASK,
            PACKED_COLUMNS=PACKED_COLUMNS,
            COL_TOKEN_ID=COL_TOKEN_ID,
            COL_LOGPROB=COL_LOGPROB,
            COL_MASK_LEN=COL_MASK_LEN,
            COL_MASK_LOGPROB=COL_MASK_LOGPROB,
            COL_ROW_MAX=COL_ROW_MAX,
            COL_Z=COL_Z,
            num_warps=8 if blocks["BLOCK_F"] >= 1024 else 4,
            enable_fp_fusion=False,
        ),
    )
    return [row_stats, select]


def unpack(packed: np.ndarray) -> dict[str, np.ndarray]:
    """The packed int32 [R, PACKED_COLUMNS + 2W] output (on the host) as per-row arrays by field name."""
    packed = np.ascontiguousarray(packed, dtype=np.int32)
    if packed.ndim != 2 or packed.shape[1] < PACKED_COLUMNS or (packed.shape[1] - PACKED_COLUMNS) % 2:
        raise ValueError(f"packed must be int32 [rows, {PACKED_COLUMNS} + 2 W], got {packed.shape}")
    width = (packed.shape[1] - PACKED_COLUMNS) // 2

    def as_float(column):
        return np.ascontiguousarray(packed[:, column]).view(np.float32)

    return {
        outputs.OUTPUT_IDS.name: packed[:, COL_TOKEN_ID].astype(np.int64),
        outputs.OUTPUT_LOGPROBS.name: as_float(COL_LOGPROB),
        outputs.SAMPLING_MASK_LEN.name: packed[:, COL_MASK_LEN].copy(),
        outputs.SAMPLING_LOGPROBS.name: as_float(COL_MASK_LOGPROB),
        ROW_MAX: as_float(COL_ROW_MAX),
        outputs.SAMPLING_MASK.name: packed[:, PACKED_COLUMNS : PACKED_COLUMNS + width].copy(),
        outputs.SAMPLING_MASK_LOGPROBS.name: packed[:, PACKED_COLUMNS + width :].copy().view(np.float32),
    }


class PackedResult(HostResult):
    """The fused path's result: the packed int32 device tensor of `sample_packed`, copied to the
    host and unpacked once, by the first `host()` (or field read)."""

    def __init__(self, packed: torch.Tensor):
        self.packed = packed
        self.arrays = None

    def host(self) -> dict[str, np.ndarray]:
        if self.arrays is None:
            self.arrays = unpack(self.packed.cpu().numpy())
        return self.arrays


def debug_noise(seeds: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' own uniforms and Gumbel noise for seeds [R] and token ids [R, n] (tests only).

    Runs the same @triton.jit helpers kernel B draws with, so tests compare them with `rng`.
    """
    if not AVAILABLE:
        raise RuntimeError(_UNAVAILABLE)
    seeds = seeds.to(torch.int64).contiguous()
    token_ids = token_ids.to(torch.int64).contiguous()
    rows, count = token_ids.shape
    uniforms = torch.empty(rows, count, dtype=torch.float32, device=token_ids.device)
    noise = torch.empty_like(uniforms)
    block = max(_MIN_BLOCK, _next_power_of_two(count))
    if rows:
        _launch(_noise_kernel, (rows,), seeds, token_ids, count, uniforms, noise, BLOCK=block, enable_fp_fusion=False)
    return uniforms, noise


if AVAILABLE:
    # rng.py's constants, as int64 bit patterns (wrapping multiplies, identical to torch's).
    _MIX_MUL_1 = tl.constexpr(rng.MIX_MUL_1)
    _MIX_MUL_2 = tl.constexpr(rng.MIX_MUL_2)
    _GOLDEN_GAMMA = tl.constexpr(rng.GOLDEN_GAMMA)
    _UNIFORM_SHIFT = tl.constexpr(64 - rng.UNIFORM_BITS)
    _UNIFORM_LOW_BITS = tl.constexpr((1 << rng.UNIFORM_BITS) - 1)
    _LOW_34, _LOW_37, _LOW_33 = tl.constexpr((1 << 34) - 1), tl.constexpr((1 << 37) - 1), tl.constexpr((1 << 33) - 1)
    _UNIFORM_SCALE = tl.constexpr(1.0 / (1 << rng.UNIFORM_BITS))
    _INT64_MAX = tl.constexpr((1 << 63) - 1)

    @triton.jit
    def _mix64(x):
        """rng.mix64: SplitMix64's finaliser on int64 bit patterns."""
        # Triton's >> on int64 is arithmetic; masking off the sign extension makes it logical.
        x = (x ^ ((x >> 30) & _LOW_34)) * _MIX_MUL_1
        x = (x ^ ((x >> 27) & _LOW_37)) * _MIX_MUL_2
        return x ^ ((x >> 31) & _LOW_33)

    @triton.jit
    def _uniform(state, token_ids):
        """rng.uniform: the top 24 hash bits as a float32 in (0, 1]."""
        bits = _mix64(state + token_ids * _GOLDEN_GAMMA)
        top = ((bits >> _UNIFORM_SHIFT) & _UNIFORM_LOW_BITS).to(tl.float32)
        return (top + 0.5) * _UNIFORM_SCALE

    @triton.jit
    def _gumbel(uniforms):
        """rng.gumbel from the uniforms: -log(-log(u)) in fp32."""
        return -tl.log(-tl.log(uniforms))

    @triton.jit
    def _noise_kernel(seeds_ptr, ids_ptr, count, uniforms_ptr, noise_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        state = _mix64(tl.load(seeds_ptr + row) ^ _GOLDEN_GAMMA)  # rng.seed_state
        for start in range(0, count, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < count
            uniforms = _uniform(state, tl.load(ids_ptr + row * count + cols, mask=inside, other=0))
            tl.store(uniforms_ptr + row * count + cols, uniforms, mask=inside)
            tl.store(noise_ptr + row * count + cols, _gumbel(uniforms), mask=inside)

    # Reductions and scans go through the builtin tl.reduce / tl.associative_scan with the standard
    # library's own combine functions: on a GPU that is exactly tl.sum / tl.max / tl.min / tl.cumsum,
    # and the interpreter runs each as one numpy call, where a tl.sum call (a nested jit function)
    # costs milliseconds of re-patching per program. A Triton without these private names gets
    # the same arithmetic from the fallbacks (only the interpreter is slower).
    @triton.jit
    def _add_fallback(a, b):
        return a + b

    @triton.jit
    def _max_fallback(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _min_fallback(a, b):
        return tl.minimum(a, b)

    _add_combine = getattr(tl.standard, "_sum_combine", _add_fallback)
    _max_combine = getattr(tl.standard, "_elementwise_max", _max_fallback)
    _min_combine = getattr(tl.standard, "_elementwise_min", _min_fallback)

    @triton.jit
    def _sort_ascending(x, LOG_N: tl.constexpr):
        """Bitonic sort of an int64 block of 2**LOG_N keys: tl.sort's network over the [2] * LOG_N
        hypercube, written out in one function (the interpreter pays per nested jit call)."""
        cube = tl.reshape(x, [2] * LOG_N)
        position = tl.reshape(tl.arange(0, x.shape[0]), [2] * LOG_N)  # each key's flat index
        for stage in tl.static_range(1, LOG_N + 1):
            # Blocks of 2**stage keys sort ascending and descending alternately (the last ascending).
            descending = (position >> stage) & 1
            for step in tl.static_range(stage):
                # Compare-and-swap with the partner whose index differs in bit (stage - 1 - step),
                # the hypercube's (LOG_N - stage + step)-th axis. The partner is the pair's sum minus
                # self: int64 sums wrap and the subtraction wraps back, so it is exact (tl.sort's
                # xor_sum does the same, but the interpreter runs it element by element).
                partner = tl.reduce(cube, LOG_N - stage + step, _add_combine, keep_dims=True) - cube
                keeps_larger = (((position >> (stage - 1 - step)) & 1) ^ descending) != 0
                cube = tl.where((cube > partner) != keeps_larger, partner, cube)
        return tl.reshape(cube, x.shape)

    @triton.jit(do_not_specialize=["fetched"])  # one compiled kernel per block size, not per k
    def _row_stats_kernel(
        logits_ptr,
        logits_row_stride,
        vocab,
        params_ptr,
        values_ptr,
        ids_ptr,
        fetched,
        out_ptr,
        out_row_stride,
        BLOCK_V: tl.constexpr,
        PARAM_COLUMNS: tl.constexpr,
        PARAM_TEMPERATURE: tl.constexpr,
        PARAM_K_EFF: tl.constexpr,
        COL_ROW_MAX: tl.constexpr,
        COL_Z: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        k_eff = tl.load(params_ptr + row * PARAM_COLUMNS + PARAM_K_EFF)
        k_eff = tl.maximum(tl.minimum(k_eff, fetched), 1)  # never read out of bounds
        temperature = tl.load(params_ptr + row * PARAM_COLUMNS + PARAM_TEMPERATURE)
        temperature = temperature.to(tl.int32).to(tl.float32, bitcast=True)
        row_logits = logits_ptr + row * logits_row_stride
        row_values = values_ptr + row * fetched
        lanes = tl.arange(0, BLOCK_V)

        # Shift by the top-k maximum, which is the row max wherever the row is valid; invalid rows
        # (NaN, +inf, all -inf) may get any z, so a finite stand-in only avoids inf - inf.
        shift = tl.load(row_values).to(tl.float32)
        shift = tl.where((shift > float("-inf")) & (shift < float("inf")), shift, 0.0)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        nan_seen = tl.zeros([BLOCK_V], tl.int32)
        total = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            cols = start + lanes
            x = tl.load(row_logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            is_nan = x != x
            x = tl.where(is_nan, float("-inf"), x)
            nan_seen = nan_seen | is_nan.to(tl.int32)
            best = tl.maximum(best, x)
            total += tl.exp(tl.math.div_rn(x - shift, temperature))
        row_max = tl.reduce(best, 0, _max_combine)
        row_max = tl.where(tl.reduce(nan_seen, 0, _add_combine) > 0, float("nan"), row_max)
        out_row = out_ptr + row * out_row_stride
        tl.store(out_row + COL_ROW_MAX, row_max.to(tl.int32, bitcast=True))
        tl.store(out_row + COL_Z, tl.reduce(total, 0, _add_combine).to(tl.int32, bitcast=True))

        # Boundary tie repair: the value at place k_eff - 1 equals the last fetched one, so a run of
        # equal logits may reach past the fetched set and topk chose arbitrary members of it.
        boundary = tl.load(row_values + k_eff - 1).to(tl.float32)
        last = tl.load(row_values + fetched - 1).to(tl.float32)
        if (boundary == last) & (boundary > float("-inf")) & (fetched < vocab):
            # F <= BLOCK_V (F <= V, and F <= 1024 + 16 + 256 < 4096): one block holds every candidate.
            fetched_values = tl.load(row_values + lanes, mask=lanes < fetched, other=float("-inf")).to(tl.float32)
            above = tl.reduce((fetched_values > boundary).to(tl.int32), 0, _add_combine)
            # The places [above, fetched) hold the boundary value: give them the lowest tied ids.
            row_ids = ids_ptr + row * fetched
            found = above * 0
            start = above * 0
            while (start < vocab) & (above + found < fetched):
                cols = start + lanes
                x = tl.load(row_logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                tied = ((x == boundary) & (cols < vocab)).to(tl.int32)
                place = above + found + tl.associative_scan(tied, 0, _add_combine) - tied
                tl.store(row_ids + place, cols.to(tl.int64), mask=(tied > 0) & (place < fetched))
                found += tl.reduce(tied, 0, _add_combine)
                start += BLOCK_V

    @triton.jit(do_not_specialize=["fetched", "mask_width"])
    def _select_kernel(
        values_ptr,
        ids_ptr,
        fetched,
        params_ptr,
        out_ptr,
        out_row_stride,
        mask_width,
        BLOCK_F: tl.constexpr,
        LOG_F: tl.constexpr,
        PARAM_COLUMNS: tl.constexpr,
        PARAM_TEMPERATURE: tl.constexpr,
        PARAM_K_EFF: tl.constexpr,
        PARAM_TOP_P: tl.constexpr,
        PARAM_MIN_P_BOUND: tl.constexpr,
        PARAM_SEED: tl.constexpr,
        PARAM_WANT_MASK: tl.constexpr,
        PACKED_COLUMNS: tl.constexpr,
        COL_TOKEN_ID: tl.constexpr,
        COL_LOGPROB: tl.constexpr,
        COL_MASK_LEN: tl.constexpr,
        COL_MASK_LOGPROB: tl.constexpr,
        COL_ROW_MAX: tl.constexpr,
        COL_Z: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        params_row = params_ptr + row * PARAM_COLUMNS
        temperature = tl.load(params_row + PARAM_TEMPERATURE).to(tl.int32).to(tl.float32, bitcast=True)
        k_eff = tl.minimum(tl.load(params_row + PARAM_K_EFF), fetched)
        top_p = tl.load(params_row + PARAM_TOP_P).to(tl.int32).to(tl.float32, bitcast=True)
        min_p_bound = tl.load(params_row + PARAM_MIN_P_BOUND).to(tl.float64, bitcast=True)
        state = _mix64(tl.load(params_row + PARAM_SEED) ^ _GOLDEN_GAMMA)  # rng.seed_state
        want = tl.load(params_row + PARAM_WANT_MASK) != 0
        out_row = out_ptr + row * out_row_stride
        row_max = tl.load(out_row + COL_ROW_MAX).to(tl.float32, bitcast=True)
        z = tl.load(out_row + COL_Z).to(tl.float32, bitcast=True)
        log_z = tl.log(z)

        # Rank by (logit desc, id asc) with one ascending sort of a composite key: the high 32 bits
        # are the value's bits made order-preserving as a signed int, then inverted (descending),
        # the low 32 bits the id. -0.0 becomes +0.0 first: the two are equal logits, a tie.
        rank = tl.arange(0, BLOCK_F)
        in_set = rank < fetched
        values = tl.load(values_ptr + row * fetched + rank, mask=in_set, other=float("-inf")).to(tl.float32)
        ids = tl.load(ids_ptr + row * fetched + rank, mask=in_set, other=0)
        values = tl.where(values == 0.0, 0.0, values)
        bits = values.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = ((~ordered).to(tl.int64) << 32) | ids
        key = _sort_ascending(tl.where(in_set, key, _INT64_MAX), LOG_F)
        ids = key & 0xFFFFFFFF
        ordered = (~(key >> 32)).to(tl.int32)
        values = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        values = tl.where(in_set, values, float("-inf"))

        # The epilogues' prefix rules, decided as they decide them (see `epilogues`).
        # IEEE division (Triton's `/` is approximate on NVIDIA GPUs): the scores match torch's float32.
        scaled = tl.math.div_rn(values - row_max, temperature)
        relative = tl.exp(scaled)  # p / p_max: exactly 1 for logits tied at the max
        mass_before = tl.associative_scan(relative, 0, _add_combine) - relative
        keep = (rank < k_eff) & (values > float("-inf"))
        # top_p * z in float64 is exact: a prefix of exact ones meets a representable top_p exactly.
        top_p_bound = tl.where(top_p >= 1.0, float("inf"), top_p.to(tl.float64) * z.to(tl.float64))  # >= 1: off
        keep = keep & (mass_before.to(tl.float64) <= top_p_bound)
        keep = keep & (values.to(tl.float64) - row_max.to(tl.float64) >= min_p_bound)  # x - max: exact
        # The support is the leading run of kept ranks (fp32 round-off cannot punch holes in it).
        support_len = tl.reduce(tl.where(keep, BLOCK_F, rank), 0, _min_combine)
        keep = rank < support_len

        noise = _gumbel(_uniform(state, ids))
        score = tl.where(keep, scaled + noise, float("-inf"))
        best_score = tl.reduce(score, 0, _max_combine)
        pick = tl.reduce(tl.where(score == best_score, rank, BLOCK_F), 0, _min_combine)  # ties: lowest rank
        at_pick = rank == pick
        token_id = tl.reduce(tl.where(at_pick, ids, 0), 0, _add_combine)
        token_scaled = tl.reduce(tl.where(at_pick, scaled, 0.0), 0, _add_combine)
        # token_logp - logsumexp(logp over the support) = scaled[pick] - log sum exp(scaled) over
        # the support: exactly 0 for a singleton, and no log_z cancellation.
        support_mass = tl.reduce(tl.where(keep, relative, 0.0), 0, _add_combine)
        mask_logprob = tl.where(want, token_scaled - tl.log(support_mass), 0.0)
        mask_len = tl.where(want, tl.minimum(support_len, mask_width), 0)

        tl.store(out_row + COL_TOKEN_ID, token_id.to(tl.int32))
        tl.store(out_row + COL_LOGPROB, (token_scaled - log_z).to(tl.int32, bitcast=True))
        tl.store(out_row + COL_MASK_LEN, mask_len.to(tl.int32))
        tl.store(out_row + COL_MASK_LOGPROB, mask_logprob.to(tl.int32, bitcast=True))
        mask_row = out_row + PACKED_COLUMNS
        tl.store(mask_row + rank, tl.where(rank < mask_len, ids, -1).to(tl.int32), mask=rank < mask_width)
        # Then each mask id's log-probability renormalised over the support (the sampled one's
        # equals mask_logprob exactly), -inf padded, as float32 bits.
        support_row = mask_row + mask_width
        support_logp = tl.where(rank < mask_len, scaled - tl.log(support_mass), float("-inf"))
        tl.store(support_row + rank, support_logp.to(tl.int32, bitcast=True), mask=rank < mask_width)
        # W may exceed the candidate block: the columns past it are padding, written a block at a
        # time (W is not a compile-time constant, so no kernel is compiled per mask width).
        minus_inf = tl.full([BLOCK_F], float("-inf"), tl.float32).to(tl.int32, bitcast=True)
        for start in range(BLOCK_F, mask_width, BLOCK_F):
            columns = start + rank
            tl.store(mask_row + columns, tl.full([BLOCK_F], -1, tl.int32), mask=columns < mask_width)
            tl.store(support_row + columns, minus_inf, mask=columns < mask_width)
