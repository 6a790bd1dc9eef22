// Decode attention over the paged KV pool for the CPU attention backend (rxf/plugins/attention/cpu.py):
// one query token per request, its keys read in place from the pool by slot (never copied out).
//
// Work: tasks of (request, chunk of its keys). A task keeps the request's queries in float32 and
// streams its keys in blocks of kBlock with an online softmax (a running max and sum per query; see
// attend_chunk). A request's keys are split into chunks only when there are too few requests to
// keep every thread busy; the chunks' partial results (max, sum, weighted values) are merged per
// head at the end with the sink's logit, as flash-decoding does. Everything is float32 but the
// output, written in q's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 2 * Vec::size();  // keys scored before their values are accumulated
constexpr int64_t kMinChunk = 128; // fewest keys of a chunk when a request's keys are split
constexpr int64_t kTasksPerThread = 4;

// dst[0, n) = float(src[0, n)) * scale
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n, float scale) {
  const Vec s(scale);
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; d + Vec::size() <= n; d += Vec::size()) (Vec::loadu(src + d) * s).store(dst + d);
  } else if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    for (; d + Vec::size() <= n; d += Vec::size()) {
      Vec v;
      at::vec::load_to_float<T>(src + d, v);
      (v * s).store(dst + d);
    }
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]) * scale;
}

// acc[0, n) += p * x
inline void add_scaled(float* acc, float p, const float* x, int64_t n) {
  const Vec vp(p);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) at::vec::fmadd(vp, Vec::loadu(x + d), Vec::loadu(acc + d)).store(acc + d);
  for (; d < n; ++d) acc[d] += p * x[d];
}

// x[0, n) *= c
inline void rescale(float* x, float c, int64_t n) {
  const Vec vc(c);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) (Vec::loadu(x + d) * vc).store(x + d);
  for (; d < n; ++d) x[d] *= c;
}

// x[0, n) = exp(x - m); returns their sum
inline float exp_sum(float* x, float m, int64_t n) {
  const Vec vm(m);
  Vec total(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(x + j) - vm).exp();
    e.store(x + j);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}

struct Shape {
  int64_t bs, heads, kv_heads, group, dim, slot_stride;
};

// One task: request b's keys [lo, hi), every head. Writes, per query head i,
// part[i] = {max score, sum of exp(score - max), sum of exp(score - max) * value[0, dim)}.
// A block of keys is read as whole pool rows (every KV head of a slot, contiguous), converted to
// float; per KV head its keys are transposed ([dim, kBlock]) so that the scores of the block for
// one query are kBlock-wide vector FMAs (no horizontal sum per score); the value rows are
// converted once and added into each query's accumulator. The next block's rows are prefetched.
// kD: the head dim when it is known at compile time (its loops then unroll), else 0.
template <typename Q, typename KV, int64_t kD>
void attend_chunk(const Shape& s, const Q* q, const KV* k_buf, const KV* v_buf, float k_scale, float v_scale,
                  const int64_t* slots, int64_t b, int64_t lo, int64_t hi, float scale, float cap, float* part,
                  std::vector<float>& scratch) {
  const int64_t G = s.group, D = kD ? kD : s.dim, H = s.heads, W = s.kv_heads * D;  // W: a slot's row
  scratch.resize(H * D + kBlock * W + kBlock * D + H * kBlock + 2 * H);
  float* qf = scratch.data();          // [H, D], pre-scaled
  float* rows = qf + H * D;            // [kBlock, W]: the block's key rows, then its value rows
  float* keys_t = rows + kBlock * W;   // [D, kBlock]: one KV head's keys
  float* score = keys_t + kBlock * D;  // [H, kBlock]
  float* mx = score + H * kBlock;      // [H]
  float* sum = mx + H;                 // [H]
  to_float(q + b * H * D, qf, H * D, scale);
  for (int64_t i = 0; i < H; ++i) {
    mx[i] = -std::numeric_limits<float>::infinity();
    sum[i] = 0.f;
    std::fill_n(part + i * (D + 2) + 2, D, 0.f);
  }
  const int64_t* row_slots = slots + b * s.slot_stride;
  for (int64_t l0 = lo; l0 < hi; l0 += kBlock) {
    const int64_t n = std::min(kBlock, hi - l0);
    for (int64_t j = l0 + kBlock; j < std::min(hi, l0 + 2 * kBlock); ++j) {
      for (int64_t off = 0; off < W * int64_t(sizeof(KV)); off += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_buf + row_slots[j] * W) + off);
        __builtin_prefetch(reinterpret_cast<const char*>(v_buf + row_slots[j] * W) + off);
      }
    }
    for (int64_t j = 0; j < n; ++j) to_float(k_buf + row_slots[l0 + j] * W, rows + j * W, W, k_scale);
    std::fill_n(rows + n * W, (kBlock - n) * W, 0.f);  // a short block's last keys score 0, then drop out
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      at::vec::transpose_mxn<float>(rows + h * D, W, keys_t, kBlock, kBlock, D);
      for (int64_t i = h * G; i < (h + 1) * G; ++i) {
        Vec acc[kBlock / Vec::size()];
        for (auto& x : acc) x = Vec(0.f);
        for (int64_t d = 0; d < D; ++d) {
          const Vec qd(qf[i * D + d]);
          for (int64_t v = 0; v < kBlock / Vec::size(); ++v)
            acc[v] = at::vec::fmadd(qd, Vec::loadu(keys_t + d * kBlock + v * Vec::size()), acc[v]);
        }
        float* si = score + i * kBlock;
        for (int64_t v = 0; v < kBlock / Vec::size(); ++v) {
          Vec x = acc[v];
          if (cap > 0.f) x = Vec(cap) * (x / Vec(cap)).tanh();
          x.store(si + v * Vec::size());
        }
        const float m = std::max(mx[i], *std::max_element(si, si + n));
        if (m > mx[i] && l0 > lo) {  // the weights so far were relative to a smaller max
          const float corr = std::exp(mx[i] - m);
          sum[i] *= corr;
          rescale(part + i * (D + 2) + 2, corr, D);
        }
        mx[i] = m;
        sum[i] += exp_sum(si, m, n);
      }
    }
    for (int64_t j = 0; j < n; ++j) to_float(v_buf + row_slots[l0 + j] * W, rows + j * W, W, v_scale);
    for (int64_t i = 0; i < H; ++i) {
      float* out = part + i * (D + 2) + 2;
      const float* p = score + i * kBlock;
      const float* values = rows + (i / G) * D;
      if constexpr (kD > 0 && kD % Vec::size() == 0) {  // the accumulator in registers across the block
        Vec a[kD / Vec::size()];
        for (int64_t v = 0; v < kD / Vec::size(); ++v) a[v] = Vec::loadu(out + v * Vec::size());
        for (int64_t j = 0; j < n; ++j) {
          const Vec pj(p[j]);
          for (int64_t v = 0; v < kD / Vec::size(); ++v)
            a[v] = at::vec::fmadd(pj, Vec::loadu(values + j * W + v * Vec::size()), a[v]);
        }
        for (int64_t v = 0; v < kD / Vec::size(); ++v) a[v].store(out + v * Vec::size());
      } else {
        for (int64_t j = 0; j < n; ++j) add_scaled(out, p[j], values + j * W, D);
      }
    }
  }
  for (int64_t i = 0; i < H; ++i) {
    part[i * (D + 2)] = mx[i];
    part[i * (D + 2) + 1] = sum[i];
  }
}

template <typename Q, typename KV, int64_t kD>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, float k_scale,
         float v_scale, const at::Tensor& slots, const int32_t* seq_lens, const int32_t* first_key,
         const float* sinks, float scale, float cap, at::Tensor& out) {
  const int64_t D = s.dim, H = s.heads;
  // Chunks: enough (request, chunk) tasks for every thread, none shorter than kMinChunk keys.
  int64_t total_keys = 0;
  for (int64_t b = 0; b < s.bs; ++b) total_keys += std::max<int64_t>(0, seq_lens[b] - first_key[b]);
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  const int64_t chunk = std::max(kMinChunk, (total_keys + wanted - 1) / wanted);
  std::vector<int64_t> first_chunk(s.bs + 1, 0);  // request b's chunks: [first_chunk[b], first_chunk[b + 1])
  std::vector<int64_t> chunk_request;
  for (int64_t b = 0; b < s.bs; ++b) {
    const int64_t keys = std::max<int64_t>(0, seq_lens[b] - first_key[b]);
    const int64_t n = std::max<int64_t>(1, (keys + chunk - 1) / chunk);
    first_chunk[b + 1] = first_chunk[b] + n;
    chunk_request.insert(chunk_request.end(), n, b);
  }
  const int64_t chunks = first_chunk[s.bs];
  const int64_t part_size = H * (D + 2);
  std::vector<float> parts(chunks * part_size);
  const Q* qp = q.const_data_ptr<Q>();
  const KV* kp = k_buf.const_data_ptr<KV>();
  const KV* vp = v_buf.const_data_ptr<KV>();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t b = chunk_request[c], n = first_chunk[b + 1] - first_chunk[b];
      const int64_t keys = std::max<int64_t>(0, seq_lens[b] - first_key[b]);
      const int64_t per = (keys + n - 1) / n;
      const int64_t lo = first_key[b] + (c - first_chunk[b]) * per;
      const int64_t hi = std::min<int64_t>(seq_lens[b], lo + per);
      attend_chunk<Q, KV, kD>(s, qp, kp, vp, k_scale, v_scale, sp, b, lo, std::max(lo, hi), scale, cap,
                              parts.data() + c * part_size, scratch);
    }
  });
  Q* op = out.data_ptr<Q>();
  at::parallel_for(0, s.bs * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, head = i % H;
      float m = sinks[head];
      for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; ++c) m = std::max(m, parts[c * part_size + head * (D + 2)]);
      float total = std::isinf(sinks[head]) ? 0.f : std::exp(sinks[head] - m);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; ++c) {
        const float* p = parts.data() + c * part_size + head * (D + 2);
        if (std::isinf(p[0])) continue;  // an empty chunk
        const float w = std::exp(p[0] - m);
        total += p[1] * w;
        add_scaled(acc.data(), w, p + 2, D);
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      Q* o = op + i * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Q>(acc[d] * inv);
    }
  });
}

struct Args {
  const at::Tensor &q, &k_buf, &v_buf, &slots;
  float k_scale, v_scale;
  const int32_t *seq_lens, *first_key;
  const float* sinks;
  float scale, cap;
};

template <typename Q, typename KV>
void dispatch_dim(const Shape& s, const Args& a, at::Tensor& out) {
  const auto go = [&](auto kd) {
    run<Q, KV, decltype(kd)::value>(s, a.q, a.k_buf, a.v_buf, a.k_scale, a.v_scale, a.slots, a.seq_lens, a.first_key,
                                     a.sinks, a.scale, a.cap, out);
  };
  if (s.dim == 64) return go(std::integral_constant<int64_t, 64>{});
  if (s.dim == 128) return go(std::integral_constant<int64_t, 128>{});
  go(std::integral_constant<int64_t, 0>{});
}

// The pool holds the model's dtype, or FP8 (dequantized with the layer's scales).
template <typename Q>
void dispatch_kv(const Shape& s, const Args& a, at::Tensor& out) {
  const auto kv = a.k_buf.scalar_type();
  if (kv == a.q.scalar_type()) return dispatch_dim<Q, Q>(s, a, out);
  if (kv == at::kFloat8_e4m3fn) return dispatch_dim<Q, c10::Float8_e4m3fn>(s, a, out);
  if (kv == at::kFloat8_e5m2) return dispatch_dim<Q, c10::Float8_e5m2>(s, a, out);
  TORCH_CHECK(false, "paged_decode_attention: a KV pool of ", kv, " for queries of ", a.q.scalar_type());
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                                  const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& slots,
                                  const at::Tensor& seq_lens, const at::Tensor& first_key, const at::Tensor& sinks,
                                  double scale, std::optional<double> cap) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(), "q [bs, H, D], k/v [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "contiguous q and pool buffers");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.stride(1) == 1, "slots int64 [bs, L]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && first_key.scalar_type() == at::kInt, "int32 seq_lens, first_key");
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == q.size(1), "float32 sinks, one per head");
  const Shape s{q.size(0), q.size(1), k_buf.size(1), q.size(1) / k_buf.size(1), q.size(2), slots.stride(0)};
  TORCH_CHECK(s.group * s.kv_heads == s.heads && k_buf.size(2) == s.dim, "head shapes");
  TORCH_CHECK(slots.size(0) == s.bs && seq_lens.numel() == s.bs && first_key.numel() == s.bs, "one row per request");
  auto seq = seq_lens.contiguous(), first = first_key.contiguous(), sk = sinks.contiguous();
  auto out = at::empty(q.sizes(), q.options());
  const float ks = k_scale.item<float>(), vs = v_scale.item<float>(), c = cap.has_value() ? float(*cap) : 0.f;
  const Args a{q, k_buf, v_buf, slots, ks, vs, seq.const_data_ptr<int32_t>(), first.const_data_ptr<int32_t>(),
               sk.const_data_ptr<float>(), float(scale), c};
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_kv<float>(s, a, out); break;
    case at::kBFloat16: dispatch_kv<at::BFloat16>(s, a, out); break;
    case at::kHalf: dispatch_kv<at::Half>(s, a, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: q dtype ", q.scalar_type(), " not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(rxf_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor k_scale, Tensor v_scale, Tensor slots, "
      "Tensor seq_lens, Tensor first_key, Tensor sinks, float scale, float? cap) -> Tensor");
}

TORCH_LIBRARY_IMPL(rxf_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
