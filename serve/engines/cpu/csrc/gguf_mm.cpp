// y[M, N] = x[M, K] @ W^T with W held as GGUF blocks of 32 along K (row n, block g), read as stored in the file:
//   Q4_1: w = q * d + m, q in 0..15, qs[n, g, j] = q_j | q_{j+16} << 4  (GGUF's own byte order)
//   Q8_0: w = q * d,     q int8,     qs[n, g, j] = q_j
// d, m: fp16 [N, G], widened exactly to fp32 (F16C). Each weight is formed exactly: q * d is exact in fp32 (an
// 8-bit integer times an 11-bit significand), so the one rounding of the FMA with m is the rounding of fp32
// `d * q + m`, which is how the engine's dequantized fp32 tensors were made. x * w accumulates in fp32.
//
// One source, two builds (serve/engines/cpu/gguf_linear.py picks one at run time and names the extension after it):
// compiled with -mavx512f it uses 16-lane vectors, else (-mavx2 -mfma -mf16c) 8-lane ones. The summation order of
// an output element depends only on its own x row and weight row (never on M, the tile shapes or the thread count),
// so a row computed among M rows equals the row alone and 1 thread equals 2. The two builds sum in different orders
// (16 vs 8 lanes), so they differ from each other in the last bits, each deterministically.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#if defined(__AVX512F__)
using V = __m512;
constexpr int LANES = 16;
static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vset(float a) { return _mm512_set1_ps(a); }
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
static inline V i8(const uint8_t* p) {  // 16 signed bytes -> 16 floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline V u8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using V = __m256;
constexpr int LANES = 8;
static inline V vzero() { return _mm256_setzero_ps(); }
static inline V vset(float a) { return _mm256_set1_ps(a); }
static inline V vload(const float* p) { return _mm256_loadu_ps(p); }
static inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(V a) {  // a fixed pairwise order: (lo + hi) halves, then within 128 bits
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline V i8(const uint8_t* p) {  // 8 signed bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline V u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
#else
#error "gguf_mm needs AVX-512 (-mavx512f -mavx512bw -mavx512vl) or AVX2 with FMA and F16C (-mavx2 -mfma -mf16c)"
#endif

constexpr int NV = 32 / LANES;  // vectors per block of 32 weights

// fp16 -> fp32 with the F16C instruction (exact); c10's portable conversion is a bit-twiddling routine.
static inline float half(at::Half h) { return _cvtsh_ss(h.x); }

// The block's 32 weights, in K order, as NV vectors.
template <bool Q8>
static inline void block_weights(const uint8_t* qs, float d, float m, V* w) {
  const V vd = vset(d);
  if constexpr (Q8) {
    for (int v = 0; v < NV; ++v) w[v] = vmul(i8(qs + v * LANES), vd);
  } else {
    const __m128i raw = _mm_loadu_si128((const __m128i*)qs);
    const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));                      // q_0 .. q_15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));  // q_16 .. q_31
    const V vm = vset(m);
    if constexpr (NV == 2) {
      w[0] = vfma(u8(lo), vd, vm);
      w[1] = vfma(u8(hi), vd, vm);
    } else {
      w[0] = vfma(u8(lo), vd, vm);
      w[1] = vfma(u8(_mm_srli_si128(lo, 8)), vd, vm);
      w[2] = vfma(u8(hi), vd, vm);
      w[3] = vfma(u8(_mm_srli_si128(hi, 8)), vd, vm);
    }
  }
}

// MB query rows x NT output columns, accumulators in registers; the block's weights are formed once per column and
// serve every query row while they sit in registers.
template <bool Q8, int MB, int NT>
static void tile(const float* x, int64_t K, const uint8_t* qs, const at::Half* d, const at::Half* m,
                 int64_t G, int64_t n0, float* y, int64_t N) {
  constexpr int64_t BYTES = Q8 ? 32 : 16;
  V acc[MB][NT];
  for (int i = 0; i < MB; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = vzero();
  for (int64_t g = 0; g < G; ++g) {
    V xv[MB][NV];
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < NV; ++v) xv[i][v] = vload(x + i * K + g * 32 + v * LANES);
    for (int t = 0; t < NT; ++t) {
      const int64_t r = (n0 + t) * G + g;
      V w[NV];
      block_weights<Q8>(qs + r * BYTES, half(d[r]), Q8 ? 0.f : half(m[r]), w);
      for (int i = 0; i < MB; ++i)
        for (int v = 0; v < NV; ++v) acc[i][t] = vfma(xv[i][v], w[v], acc[i][t]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int t = 0; t < NT; ++t) y[i * N + n0 + t] = vsum(acc[i][t]);
}

template <bool Q8, int MB, int NT>
static inline void sub(const float* x, int64_t K, const uint8_t* qs, const at::Half* d, const at::Half* m,
                       int64_t G, int64_t n0, float* y, int64_t N) {
  for (int s = 0; s < 8; s += NT) tile<Q8, MB, NT>(x, K, qs, d, m, G, n0 + s, y, N);
}

// Tiles of 8 output columns (split among threads); query rows in blocks of 4 (then 3, 2, 1). Accumulators per call
// = MB x NT <= 8, so that they, x and the weights fit the registers (32 with AVX-512, 16 with AVX2: there x spills
// to L1, which the FMA reads as a memory operand).
template <bool Q8>
static void rows(const float* xp, int64_t M, int64_t K, const uint8_t* qp, const at::Half* dp, const at::Half* mp,
                 int64_t G, int64_t n0, float* yp, int64_t N) {
  for (int64_t i = 0; i < M;) {
    const int64_t left = M - i;
    const float* xi = xp + i * K;
    float* yi = yp + i * N;
    if (left >= 4) { sub<Q8, 4, 2>(xi, K, qp, dp, mp, G, n0, yi, N); i += 4; }
    else if (left == 3) { sub<Q8, 3, 2>(xi, K, qp, dp, mp, G, n0, yi, N); i += 3; }
    else if (left == 2) { sub<Q8, 2, 4>(xi, K, qp, dp, mp, G, n0, yi, N); i += 2; }
    else { sub<Q8, 1, 8>(xi, K, qp, dp, mp, G, n0, yi, N); i += 1; }
  }
}

static torch::Tensor gguf_mm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                             const torch::Tensor& m, bool q8) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(qs.dtype() == torch::kUInt8 && qs.dim() == 3 && qs.is_contiguous(), "qs: contiguous uint8 [N, G, B]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && N % 8 == 0 && qs.size(1) == G && qs.size(2) == (q8 ? 32 : 16),
              "shapes: K % 32 == 0, N % 8 == 0, qs [N, K/32, 16 (Q4_1) or 32 (Q8_0)]");
  TORCH_CHECK(d.dtype() == torch::kHalf && d.is_contiguous() && d.numel() == N * G, "d: contiguous fp16 [N, K/32]");
  TORCH_CHECK(q8 || (m.dtype() == torch::kHalf && m.is_contiguous() && m.numel() == N * G),
              "m: contiguous fp16 [N, K/32]");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = q8 ? dp : m.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 8, 4, [&](int64_t b, int64_t e) {
    for (int64_t nt = b; nt < e; ++nt) {  // the tile's weights stay in L1 while every query block passes over them
      if (q8) rows<true>(xp, M, K, qp, dp, mp, G, nt * 8, yp, N);
      else rows<false>(xp, M, K, qp, dp, mp, G, nt * 8, yp, N);
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

int64_t lanes() { return LANES; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q4_1_mm", &q4_1_mm, "x [M, K] fp32 @ Q4_1 blocks [N, K/32] ^T -> [M, N] fp32");
  module.def("q8_0_mm", &q8_0_mm, "x [M, K] fp32 @ Q8_0 blocks [N, K/32] ^T -> [M, N] fp32");
  module.def("lanes", &lanes, "vector width of this build (16: AVX-512, 8: AVX2)");
}
