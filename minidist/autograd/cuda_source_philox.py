"""The CUDA C source of the dropout numbers' kernel: the same Philox4x32-10 numbers as
minidist/autograd/dropout_keys.py computes in xp code (philox.py), in one launch instead of
the xp code's ~100 elementwise ones (ten rounds of ten array ops):

    philox_uniforms   out (n, 4) float: for counter i, Philox4x32-10 of (blocks[i] low 32
                      bits, blocks[i] high 32 bits, rows[i], step) under key (k0, k1), each
                      of the four words' top 24 bits times 2**-24

One thread per counter, grid-stride. Proven on the CPU bit for bit against the xp code
(tests/test_cuda_philox_cpu.py, through tests/cuda_cpu.py); never run on a GPU.
DropoutKeys calls it on cupy arrays with MINIDIST_CUDA_NEW_KERNELS=1.
"""

PHILOX = r"""
extern "C" __global__ void philox_uniforms(const long long* blocks, const long long* rows,
                                           float* out, long long n, long long step,
                                           long long k0, long long k1) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long b = (unsigned long long)blocks[i];
        unsigned int c0 = (unsigned int)b, c1 = (unsigned int)(b >> 32);
        unsigned int c2 = (unsigned int)rows[i], c3 = (unsigned int)step;
        unsigned int a0 = (unsigned int)k0, a1 = (unsigned int)k1;
        for (int r = 0; r < 10; ++r) {
            if (r) {                                       // the key schedule's Weyl steps
                a0 += 0x9E3779B9u;
                a1 += 0xBB67AE85u;
            }
            unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
            unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ a0;
            unsigned int n2 = (unsigned int)(p0 >> 32) ^ c3 ^ a1;
            c1 = (unsigned int)p1;
            c3 = (unsigned int)p0;
            c0 = n0;
            c2 = n2;
        }
        const float unit = 1.0f / 16777216.0f;             // 2**-24: exact in float
        out[4 * i] = (float)(c0 >> 8) * unit;
        out[4 * i + 1] = (float)(c1 >> 8) * unit;
        out[4 * i + 2] = (float)(c2 >> 8) * unit;
        out[4 * i + 3] = (float)(c3 >> 8) * unit;
    }
}
"""

PHILOX_NAMES = ("philox_uniforms",)
