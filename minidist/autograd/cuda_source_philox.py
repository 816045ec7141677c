"""The CUDA C source of the dropout numbers' kernel: the same Philox4x32-10 numbers as
minidist/autograd/dropout_keys.py computes in xp code (philox.py), in one launch instead of
the xp code's ~100 elementwise ones (ten rounds of ten array ops):

    philox_uniforms   out (n, 4) float: for counter i, Philox4x32-10 of (blocks[i] low 32
                      bits, blocks[i] high 32 bits, rows[i], step) under key (k0, k1), each
                      of the four words' top 24 bits times 2**-24; step = count[0] - lag,
                      read on the device (DropoutKeys.device_step: a captured CUDA graph
                      replays the launch, and each replay reads the count as advanced)

One thread per counter, grid-stride. `PHILOX_DEVICE` (the rounds, and one number of a row)
is shared with the flash kernels' dropout. Proven on the CPU bit for bit against the xp code
(tests/test_cuda_philox_cpu.py, through tests/cuda_cpu.py); never run on a GPU.
DropoutKeys calls it on cupy arrays with MINIDIST_CUDA_NEW_KERNELS=1.
"""

# Philox4x32-10 and dropout's number from it, for any kernel that draws dropout's numbers
# (philox_uniforms below; the flash kernels, cuda_source_flash.py)
PHILOX_DEVICE = r"""
// counter c[4] -> Philox4x32-10's four words under key (k0, k1), in place (philox.py)
__device__ __forceinline__ void philox4x32_10(unsigned int* c, unsigned int k0,
                                              unsigned int k1) {
    for (int r = 0; r < 10; ++r) {
        if (r) {                                           // the key schedule's Weyl steps
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned long long p0 = 0xD2511F53ull * c[0], p1 = 0xCD9E8D57ull * c[2];
        unsigned int n0 = (unsigned int)(p1 >> 32) ^ c[1] ^ k0;
        unsigned int n2 = (unsigned int)(p0 >> 32) ^ c[3] ^ k1;
        c[1] = (unsigned int)p1;
        c[3] = (unsigned int)p0;
        c[0] = n0;
        c[2] = n2;
    }
}

__device__ __forceinline__ float unit24(unsigned int w) {     // top 24 bits times 2**-24
    return (float)(w >> 8) * (1.0f / 16777216.0f);
}

// dropout_keys.py's number at flat index `flat` of global row `row`: word flat % 4 of
// counter (flat / 4 low 32 bits, high 32 bits, row, step) under key (k0, k1)
__device__ __forceinline__ float philox_number(long long flat, long long row, long long step,
                                               long long k0, long long k1) {
    unsigned long long b = (unsigned long long)flat >> 2;
    unsigned int c[4] = {(unsigned int)b, (unsigned int)(b >> 32), (unsigned int)row,
                         (unsigned int)step};
    philox4x32_10(c, (unsigned int)k0, (unsigned int)k1);
    return unit24(c[flat & 3]);
}
"""

PHILOX = r"""
extern "C" __global__ void philox_uniforms(const long long* blocks, const long long* rows,
                                           float* out, long long n, const long long* count,
                                           long long lag, long long k0, long long k1) {
    const long long step = count[0] - lag;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long b = (unsigned long long)blocks[i];
        unsigned int c[4] = {(unsigned int)b, (unsigned int)(b >> 32), (unsigned int)rows[i],
                             (unsigned int)step};
        philox4x32_10(c, (unsigned int)k0, (unsigned int)k1);
        for (int j = 0; j < 4; ++j) out[4 * i + j] = unit24(c[j]);
    }
}
"""

PHILOX_NAMES = ("philox_uniforms",)
