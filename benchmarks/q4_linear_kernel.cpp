#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// y[M, N] = x[M, K] @ W^T with W held as GGUF blocks of 32 along K (row n, block g):
//   Q4_1: w = q * d + m, q in 0..15, qs[n, g, j] = q_j | q_{j+16} << 4  (GGUF's own byte order)
//   Q8_0: w = q * d,     q int8,     qs[n, g, j] = q_j
// d, m: fp16 [N, G], widened exactly to fp32. Each weight is formed exactly (q * d is exact in fp32, so the FMA
// with m rounds once, as fp32 d * q + m does) and multiplied into fp32 accumulators, 16 lanes per row.

// fp16 -> fp32 with the F16C instruction (exact); c10's portable conversion is a bit-twiddling routine.
static inline float half(at::Half h) { return _cvtsh_ss(h.x); }

template <bool Q8>
static inline void block_weights(const uint8_t* qs, float d, float m, __m512& w0, __m512& w1) {
  const __m512 vd = _mm512_set1_ps(d);
  if constexpr (Q8) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)qs);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), vd);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), vd);
  } else {
    const __m128i v = _mm_loadu_si128((const __m128i*)qs);
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    const __m512 vm = _mm512_set1_ps(m);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vm);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vm);
  }
}

template <bool Q8, int MB, int NT>
static void tile(const float* x, int64_t K, const uint8_t* qs, const at::Half* d, const at::Half* m,
                 int64_t G, int64_t n0, float* y, int64_t N) {
  constexpr int64_t BYTES = Q8 ? 32 : 16;
  __m512 acc[MB][NT];
  for (int i = 0; i < MB; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 xa[MB], xb[MB];
    for (int i = 0; i < MB; ++i) {
      xa[i] = _mm512_loadu_ps(x + i * K + g * 32);
      xb[i] = _mm512_loadu_ps(x + i * K + g * 32 + 16);
    }
    for (int t = 0; t < NT; ++t) {
      const int64_t r = (n0 + t) * G + g;
      __m512 w0, w1;
      block_weights<Q8>(qs + r * BYTES, half(d[r]), Q8 ? 0.f : half(m[r]), w0, w1);
      for (int i = 0; i < MB; ++i) {
        acc[i][t] = _mm512_fmadd_ps(xa[i], w0, acc[i][t]);
        acc[i][t] = _mm512_fmadd_ps(xb[i], w1, acc[i][t]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int t = 0; t < NT; ++t) y[i * N + n0 + t] = _mm512_reduce_add_ps(acc[i][t]);
}

template <bool Q8, int MB, int NT>
static inline void sub(const float* x, int64_t K, const uint8_t* qs, const at::Half* d, const at::Half* m,
                       int64_t G, int64_t n0, float* y, int64_t N) {
  for (int s = 0; s < 8; s += NT) tile<Q8, MB, NT>(x, K, qs, d, m, G, n0 + s, y, N);
}

// Row tiles of 8 output columns; query rows in blocks of 4 (then 3, 2, 1) so that one dequantized block serves
// every query row of the block while it sits in registers.
static torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m, bool q8) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && N % 8 == 0 && qs.size(1) == G, "shapes: K % 32, N % 8, qs [N, K/32, bytes]");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = q8 ? dp : m.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  constexpr int NT = 8;
  at::parallel_for(0, N / NT, 4, [&](int64_t b, int64_t e) {
    for (int64_t nt = b; nt < e; ++nt) {  // the tile's weights stay in L1 while every query block passes over them
      for (int64_t i = 0; i < M;) {
        const int64_t left = M - i, n0 = nt * NT;
        const float* xi = xp + i * K;
        float* yi = yp + i * N;
        // accumulators per call = MB x sub-tile rows <= 8, so that they, x and the weights fit the 32 registers
        if (q8) {
          if (left >= 4) { sub<true, 4, 2>(xi, K, qp, dp, mp, G, n0, yi, N); i += 4; }
          else if (left == 3) { sub<true, 3, 2>(xi, K, qp, dp, mp, G, n0, yi, N); i += 3; }
          else if (left == 2) { sub<true, 2, 4>(xi, K, qp, dp, mp, G, n0, yi, N); i += 2; }
          else { sub<true, 1, 8>(xi, K, qp, dp, mp, G, n0, yi, N); i += 1; }
        } else {
          if (left >= 4) { sub<false, 4, 2>(xi, K, qp, dp, mp, G, n0, yi, N); i += 4; }
          else if (left == 3) { sub<false, 3, 2>(xi, K, qp, dp, mp, G, n0, yi, N); i += 3; }
          else if (left == 2) { sub<false, 2, 4>(xi, K, qp, dp, mp, G, n0, yi, N); i += 2; }
          else { sub<false, 1, 8>(xi, K, qp, dp, mp, G, n0, yi, N); i += 1; }
        }
      }
    }
  });
  return y;
}

torch::Tensor q4_1_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  return gguf_mm(x, qs, d, m, false);
}

torch::Tensor q8_0_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  return gguf_mm(x, qs, d, d, true);
}
