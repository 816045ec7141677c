"""The CPU harness for CUDA kernels (tests/cuda_cpu.py, tests/cuda_host/cuda_host.h) itself:
__half and __nv_bfloat16 convert exactly as numpy and ml_dtypes (every 16-bit pattern to
float, and floats to them: random, every tie, the overflow and subnormal edges), shuffles
follow CUDA's lane rules, __shared__ is one copy per block (poisoned at each block's start),
atomics add up, 2-D blocks and grids are numbered as CUDA numbers them, and a divergent
barrier, a deadlock, a block too large, a write past an argument, a Python scalar and a grid
or block that is not a tuple (CuPy's launch takes tuples only) are refused with a message, as
are a grid or block outside CUDA's limits and an argument of another dtype than the source's
typedef T or A names.
Run: python -m pytest -q tests/test_cuda_cpu.py
"""
import numpy as np
import pytest

import cuda_cpu

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))


@pytest.mark.parametrize("cxx", [None, "no-such-compiler"])
def test_without_a_compiler_the_kernel_tests_say_why(cxx, monkeypatch):
    """What every kernel test module skips with where no C++ compiler is found."""
    monkeypatch.setenv("PATH", "")
    if cxx:
        monkeypatch.setenv("CXX", cxx)
    else:
        monkeypatch.delenv("CXX", raising=False)
    assert cuda_cpu.compiler() is None
    assert "no C++ compiler" in cuda_cpu.reason_unavailable()

SRC = r"""
#include <cuda_fp16.h>
extern "C" __global__ void to_half(const float* x, __half* h, __nv_bfloat16* b, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        h[i] = __float2half(x[i]);
        b[i] = __float2bfloat16(x[i]);
    }
}
extern "C" __global__ void from_half(const __half* h, const __nv_bfloat16* b, float* hf,
                                     float* bf, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        hf[i] = __half2float(h[i]);
        bf[i] = __bfloat162float(b[i]);
    }
}
extern "C" __global__ void shuffles(const double* x, double* out, int width) {
    int t = threadIdx.x, n = blockDim.x;
    double v = x[t];
    out[t] = __shfl_xor_sync(0xffffffffu, v, 5, width);
    out[n + t] = __shfl_down_sync(0xffffffffu, v, 3, width);
    out[2 * n + t] = __shfl_up_sync(0xffffffffu, v, 3, width);
    out[3 * n + t] = __shfl_sync(0xffffffffu, v, 7, width);
}
extern "C" __global__ void block_sums(const float* x, float* out) {
    __shared__ float total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    atomicAdd(&total, x[blockIdx.x * blockDim.x + threadIdx.x]);
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}
extern "C" __global__ void stale_shared(float* f, double* d, int* i, long long* q) {
    __shared__ float sf[2];
    __shared__ double sd;
    __shared__ int si;
    __shared__ long long sq;
    if (blockIdx.x == 0 && threadIdx.x == 0) sf[0] = sf[1] = 1, sd = 2, si = 3, sq = 4;
    __syncthreads();                      // block 1 reads what only block 0 wrote
    if (threadIdx.x == 0) f[blockIdx.x] = sf[1], d[blockIdx.x] = sd, i[blockIdx.x] = si,
                          q[blockIdx.x] = sq;
}
extern "C" __global__ void numbering(int* out) {
    int b = blockIdx.x + gridDim.x * blockIdx.y, nt = blockDim.x * blockDim.y;
    int t = threadIdx.x + blockDim.x * threadIdx.y;
    out[b * nt + t] = threadIdx.x + 10 * threadIdx.y + 100 * blockIdx.x + 1000 * blockIdx.y;
}
extern "C" __global__ void divergent(float* out) {
    if (threadIdx.x < 40) __syncthreads();
    out[threadIdx.x] = 1;
}
extern "C" __global__ void deadlock(float* out) {
    if (threadIdx.x == 0) __syncthreads();
    else __syncwarp();
    out[threadIdx.x] = 1;
}
extern "C" __global__ void past_the_end(float* out, long long n) {
    out[n + threadIdx.x] = 1;
}
"""


def test_half_and_bfloat16_round_as_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = np.arange(1 << 16, dtype=np.uint16)
    h, b = bits.view(np.float16), bits.view(ml_dtypes.bfloat16)
    hf, bf = np.empty(1 << 16, np.float32), np.empty(1 << 16, np.float32)
    cuda_cpu.launch(SRC, "from_half", (64,), (256,), (h, b, hf, bf, np.int64(1 << 16)))
    np.testing.assert_array_equal(hf.view(np.uint32), h.astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(bf.view(np.uint32), b.astype(np.float32).view(np.uint32))
    r = np.random.default_rng(0)
    with np.errstate(all="ignore"):
        mids = [(a[:-1] + np.diff(a) / 2) for a in (np.unique(hf[np.isfinite(hf)]),
                                                 np.unique(bf[np.isfinite(bf)]))]  # ties
        x = np.concatenate([r.standard_normal(20000) * 10.0 ** r.integers(-9, 6, 20000),
                            hf, bf, *mids, [65519.0, 65520.0, 6e-8, 3e-8, 2.9e-8]])
        x = x.astype(np.float32)
        x = x[~np.isnan(x)]
    h2, b2 = np.empty(x.size, np.float16), np.empty(x.size, ml_dtypes.bfloat16)
    cuda_cpu.launch(SRC, "to_half", (64,), (256,), (x, h2, b2, np.int64(x.size)))
    with np.errstate(over="ignore"):
        wants = (x.astype(np.float16), x.astype(ml_dtypes.bfloat16))
    for got, want in zip((h2, b2), wants):
        ok = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want))
        assert ok.all(), (x[~ok][:5], got[~ok][:5], want[~ok][:5])


@pytest.mark.parametrize("width", [32, 8])
def test_shuffles_follow_cudas_lane_rules(width):
    """Two warps; each lane reads the lane CUDA names, its own value where the source
    falls outside its segment of `width` lanes."""
    x = np.arange(64, dtype=np.float64) + 0.5
    out = np.zeros(4 * 64)
    cuda_cpu.launch(SRC, "shuffles", (1,), (64,), (x, out, np.int32(width)))
    lane = np.arange(64) % 32
    base, seg = np.arange(64) - lane, lane % width
    xor = np.where((lane ^ 5) >= (lane // width + 1) * width, lane, lane ^ 5)
    down = np.where(seg + 3 >= width, lane, lane + 3)
    up = np.where(seg < 3, lane, lane - 3)
    idx = lane // width * width + 7 % width
    for k, src in enumerate((xor, down, up, idx)):
        np.testing.assert_array_equal(out[k * 64:(k + 1) * 64], x[base + src], err_msg=str(k))


@pytest.mark.parametrize("order", ["low", "high"])
def test_shared_memory_is_per_block_and_atomics_add_up(order):
    x = np.random.default_rng(1).integers(0, 100, 5 * 96).astype(np.float32)
    out = np.zeros(5, np.float32)
    cuda_cpu.launch(SRC, "block_sums", (5,), (96,), (x, out), order)
    np.testing.assert_array_equal(out, x.reshape(5, 96).sum(1))


def test_each_block_starts_with_poisoned_shared_memory():
    """A block that reads __shared__ memory it did not write sees NaN (-1 for integers), not
    the previous block's value, as on a GPU, where a block starts with stale garbage."""
    f, d = np.zeros(2, np.float32), np.zeros(2, np.float64)
    i, q = np.zeros(2, np.int32), np.zeros(2, np.int64)
    cuda_cpu.launch(SRC, "stale_shared", (2,), (32,), (f, d, i, q))
    assert (f[0], d[0], i[0], q[0]) == (1, 2, 3, 4)
    assert np.isnan(f[1]) and np.isnan(d[1]) and i[1] == -1 and q[1] == -1


def test_two_dimensional_blocks_and_grids():
    out = np.zeros(3 * 2 * 8 * 4, np.int32)
    cuda_cpu.launch(SRC, "numbering", (3, 2), (8, 4), (out,))
    bx, by, ty, tx = np.meshgrid(range(3), range(2), range(4), range(8), indexing="ij")
    want = (tx + 10 * ty + 100 * bx + 1000 * by).transpose(1, 0, 2, 3).reshape(-1)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("name, args, block, message", [
    ("divergent", (np.zeros(64, np.float32),), 64, "reached by 40 threads while 24 have exited"),
    ("deadlock", (np.zeros(64, np.float32),), 64, "deadlock: 1 threads at __syncthreads"),
    ("past_the_end", (np.zeros(8, np.float32), np.int64(8)), 4, "wrote outside argument #0"),
    ("divergent", (np.zeros(2048, np.float32),), 2048, "CUDA allows 1..1024"),
    ("past_the_end", (np.zeros(8, np.float32), 8), 4, "got int"),
    # review 40: a scalar or an array of another width than its parameter's C type
    ("past_the_end", (np.zeros(8, np.float32), np.int32(8)), 4,
     r"argument #1 \(long long\): int32 for a long long"),
    ("past_the_end", (np.zeros(8, np.float64), np.int64(8)), 4,
     r"argument #0 \(float\*\): float64 for a float"),
    ("past_the_end", (np.zeros(8, np.float32), np.int64(8)), [4], "must be tuples, not tuple "
     "and list"),                                   # CuPy's launch refuses a list as well
])
def test_misbehaving_launches_are_refused(name, args, block, message):
    block = block if isinstance(block, list) else (block,)
    with pytest.raises(cuda_cpu.KernelError, match=message):
        cuda_cpu.launch(SRC, name, (1,), block, args)


def test_a_kernel_no_test_launched_is_named():
    """The suite's end (tests/conftest.py's pytest_sessionfinish) fails a run of every
    harness file that left a kernel unlaunched, naming it: never_launched's answer."""
    every = set(cuda_cpu.never_launched(set()))
    assert {"ln_fwd", "flash_bwd_dq", "multi_adamw", "philox_uniforms", "rope"} <= every
    assert cuda_cpu.never_launched(every) == []
    assert cuda_cpu.never_launched(every - {"ce_pad_bwd"}) == ["ce_pad_bwd"]
    names = {p.name for p in cuda_cpu.harness_files()}
    assert {"test_cuda_kernels_cpu.py", "test_cuda_flash_cpu.py", "test_fusions.py"} <= names


# a part's kernels are written over typedefs T (storage) and A (accumulation), as
# minidist/autograd/cuda_source.py's source(dtype) puts them on top
TYPED = r"""
typedef float T;
typedef float A;
extern "C" __global__ void scaled(const T* x, T* y, A s, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = x[i] * s;
}
extern "C" __global__ void chained(T* a) {  // block b reads what block b - 1 wrote: a race
    if (threadIdx.x == 0 && blockIdx.x > 0) a[blockIdx.x] = a[blockIdx.x - 1] + 1;
}
extern "C" __global__ void aliased(const T* x, T* y) {
    y[0] = 7;
    y[1] = x[0];                          // x[0] is y[0] when x is y: 7
}
"""


@pytest.mark.parametrize("args, message", [
    ((np.ones(4, np.float32), np.ones(4, np.float32), np.float64(2), np.int64(4)),
     r"argument #2 \(A\): float64 for A = float32"),  # the first H100 run's NaNs: 8-byte A
    ((np.ones(4, np.float64), np.ones(4, np.float32), np.float32(2), np.int64(4)),
     r"argument #0 \(T\*\): float64 for T = float32"),
])
def test_arguments_of_the_typedef_types_are_checked_too(args, message):
    """T and A are the source's typedefs: an A scalar or a T* array of another dtype than
    the typedef names is refused as a named C type's is (a float64 `A eps` handed to a
    float32 kernel reads 8 bytes where the kernel takes 4: garbage on a GPU)."""
    with pytest.raises(cuda_cpu.KernelError, match=message):
        cuda_cpu.launch(TYPED, "scaled", (1,), (32,), args)
    good = (np.ones(4, np.float32), np.zeros(4, np.float32), np.float32(2), np.int64(4))
    cuda_cpu.launch(TYPED, "scaled", (1,), (32,), good)
    np.testing.assert_array_equal(good[1], 2)


@pytest.mark.parametrize("grid, block, message", [
    ((0,), (32,), r"grid \(0,\)"),                   # CUDA: an invalid launch, not a no-op
    ((1, 0), (32,), r"grid \(1, 0\)"),
    ((1, 65536), (32,), r"grid \(1, 65536\)"),       # gridDim.y <= 65535
    ((1, 1, 65536), (32,), r"grid \(1, 1, 65536\)"),
    ((2 ** 31,), (32,), r"grid \(2147483648,\)"),    # gridDim.x <= 2^31 - 1
    ((1,), (0,), r"block \(0,\)"),
    ((1,), (1, 1, 65), r"block \(1, 1, 65\)"),       # blockDim.z <= 64
    ((1,), (1, 1, 1, 1), r"block \(1, 1, 1, 1\)"),
    ((1, 1, 1, 1), (32,), r"grid \(1, 1, 1, 1\)"),
])
def test_launches_outside_cudas_grid_and_block_limits_are_refused(grid, block, message):
    """What cuLaunchKernel refuses is refused here too, before any block runs: a dimension
    of 0 (a grid planned for an empty input), gridDim.x > 2^31 - 1, gridDim.y or .z >
    65535, blockDim.z > 64, more than three dimensions."""
    args = (np.ones(4, np.float32), np.zeros(4, np.float32), np.float32(2), np.int64(4))
    with pytest.raises(cuda_cpu.KernelError, match=message):
        cuda_cpu.launch(TYPED, "scaled", grid, block, args)


def test_an_array_handed_twice_is_one_buffer():
    """An array handed as two arguments (rope's y = x in place; ln_fwd's b = w without a
    bias) is ONE buffer to the kernel, as on a GPU: a write through one pointer is read back
    through the other. Two arguments that overlap without being the same array are refused
    (nothing here hands such a pair)."""
    a = np.array([1, 2, 3], np.float32)
    cuda_cpu.launch(TYPED, "aliased", (1,), (1,), (a, a))
    np.testing.assert_array_equal(a, [7, 7, 3])
    b = np.array([1, 2, 3], np.float32)
    cuda_cpu.launch(TYPED, "aliased", (1,), (1,), (b.copy(), b))
    np.testing.assert_array_equal(b, [7, 1, 3])
    with pytest.raises(cuda_cpu.KernelError, match="overlaps argument #0"):
        cuda_cpu.launch(TYPED, "aliased", (1,), (1,), (a[:2], a[1:]))


def test_the_high_order_runs_the_blocks_backwards_too():
    """Blocks run one after another; "high" runs the last block first (z, y, x all counted
    down), as a GPU may, so a kernel whose block reads what an earlier block writes in the
    same launch gets another answer in one of the two orders every kernel test runs."""
    got = {}
    for order in ("low", "high"):
        got[order] = np.zeros(4, np.float32)
        cuda_cpu.launch(TYPED, "chained", (4,), (32,), (got[order],), order)
    np.testing.assert_array_equal(got["low"], [0, 1, 2, 3])
    np.testing.assert_array_equal(got["high"], [0, 1, 1, 1])
    out = np.zeros(3 * 2 * 8 * 4, np.int32)                # numbering is the same backwards
    cuda_cpu.launch(SRC, "numbering", (3, 2), (8, 4), (out,), "high")
    bx, by, ty, tx = np.meshgrid(range(3), range(2), range(4), range(8), indexing="ij")
    want = (tx + 10 * ty + 100 * bx + 1000 * by).transpose(1, 0, 2, 3).reshape(-1)
    np.testing.assert_array_equal(out, want)
