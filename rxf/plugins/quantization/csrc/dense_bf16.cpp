// Dense bf16 matmuls on the CPU (rxf/plugins/quantization/cpu_packing.py): y = x @ W.T + bias.
//
// A batch of up to kMaxDotRows rows (a decode step of a few requests) reads each row of the plain
// [N, K] weight once, as one sequential stream, and dots it with every row of x through AVX512-BF16's
// vdpbf16ps (pairs of bf16 products summed into float32 lanes). Reading a model's weights this way
// runs at 15-19 GB/s on one core of the 2-core AMD VM, against 9-11 GB/s for oneDNN's packed layout
// (whose kernel interleaves several rows' streams) and ~20 GB/s for a plain sum over the same bytes:
// a decode step is a pass over the weights, so that is its speed (benchmarks/RESULTS.md, issue 22).
// Larger batches are compute-bound and go to oneDNN on its packed copy of the weight
// (mkldnn::_linear_pointwise), as do CPUs without AVX512-BF16 and calls without the plain weight.
//
// Sums are float32 in a different order from oneDNN's, so the two paths can differ by one bf16
// rounding of the output; bias is added in float32 before that rounding.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RXF_DOT_BF16 1
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMaxDotRows = 4;  // above: oneDNN's packed kernel (measured crossover, 1-2 threads)
constexpr int64_t kRowBlock = 64;   // rows of W per task

#ifdef RXF_DOT_BF16
#define RXF_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// One row of W against MB rows of x: MB * U float32 accumulators of 16 lanes, U chunks of 32 inputs
// in flight so that the adds of one accumulator do not wait on each other. out[m * ldo].
template <int MB>
RXF_TARGET void dot_row(const bf16* x, int64_t ldx, const bf16* w, int64_t K, float* out, int64_t ldo) {
  constexpr int U = MB == 1 ? 4 : 2;
  __m512 acc[MB][U];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U) {
    __m512bh wv[U];
    for (int u = 0; u < U; ++u) wv[u] = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
    for (int m = 0; m < MB; ++m)
      for (int u = 0; u < U; ++u)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv[u], (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32 * u));
  }
  for (; k < K; k += 32) {  // the tail: masked loads read zeros past K
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1ull << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < MB; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k));
  }
  for (int m = 0; m < MB; ++m) {
    __m512 sum = acc[m][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][u]);
    out[m * ldo] = _mm512_reduce_add_ps(sum);
  }
}

// All rows of x against one row of W, in pairs (the row stays in L1 after the first pair).
void dot_rows(const bf16* x, int64_t M, int64_t K, const bf16* w, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dot_row<2>(x + m * K, K, w, K, out + m * ldo, ldo);
  if (m < M) dot_row<1>(x + m * K, K, w, K, out + m * ldo, ldo);
}

bool cpu_has_dot_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
}

// x [M, K], w [N, K] contiguous bf16 -> [M, N] bf16.
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options());
  const bf16* xp = x.const_data_ptr<bf16>();
  const bf16* wp = w.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  at::parallel_for(0, (N + kRowBlock - 1) / kRowBlock, 1, [&](int64_t begin, int64_t end) {
    float sums[kMaxDotRows * kRowBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRowBlock, rows = std::min(kRowBlock, N - n0);
      for (int64_t n = 0; n < rows; ++n) dot_rows(xp, M, K, wp + (n0 + n) * K, sums + n, kRowBlock);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < rows; ++n)
          op[m * N + n0 + n] = bf16(sums[m * kRowBlock + n] + (bp ? bp[n0 + n] : 0.0f));
    }
  });
  return out;
}
#else
bool cpu_has_dot_bf16() { return false; }
at::Tensor dot_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "no AVX512-BF16 kernel in this build");
}
#endif

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [..., K] bf16; packed: oneDNN's layout of W (mkldnn::_reorder_linear_weight); plain: W [N, K]
// itself, or None where only the packed copy is kept.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& plain,
                        const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1);
  const int64_t M = K ? x.numel() / K : 0;
  if (plain && M > 0 && M <= kMaxDotRows && cpu_has_dot_bf16() && x.scalar_type() == at::kBFloat16 &&
      plain->scalar_type() == at::kBFloat16 && plain->dim() == 2 && plain->is_contiguous() && plain->size(1) == K) {
    auto sizes = x.sizes().vec();
    sizes.back() = plain->size(0);
    return dot_linear(x.reshape({M, K}).contiguous(), *plain, bias).view(sizes);
  }
  return packed_linear(x, packed, bias);
}

bool dot_kernel_available() { return cpu_has_dot_bf16(); }

}  // namespace

TORCH_LIBRARY(rxf_dense, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? plain, Tensor? bias) -> Tensor");
  m.def("dot_kernel_available() -> bool");
}

// (the packed weight is an MkldnnCPU tensor, whose key outranks x's CPU key at dispatch)
TORCH_LIBRARY_IMPL(rxf_dense, CPU, m) { m.impl("linear", &dense_linear); }
TORCH_LIBRARY_IMPL(rxf_dense, MkldnnCPU, m) { m.impl("linear", &dense_linear); }
TORCH_LIBRARY_IMPL(rxf_dense, CatchAll, m) { m.impl("dot_kernel_available", &dot_kernel_available); }
