// Decode attention over the paged KV pool for the CPU attention backend (rxf/plugins/attention/cpu.py):
// one query token per row, its keys read in place from the pool by slot (never copied out). A row is a
// decoding request, or one new token of an extend (its keys: the request's up to itself).
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
#include <numeric>
#include <utility>
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
  int64_t bs, heads, kv_heads, group, dim;
};

// Scores of kRows query rows (qf rows qrow[0, kRows)) against a block of keys (keys_t [D, kBlock]),
// into their rows of `score`: the block's key vectors are loaded once per dim for all kRows rows.
template <int64_t kRows, int64_t kD>
inline void score_rows(const float* qf, const int64_t* qrow, const float* keys_t, int64_t dim, float* score) {
  constexpr int64_t V = kBlock / Vec::size();
  const int64_t D = kD ? kD : dim;
  Vec acc[kRows][V];
  for (auto& row : acc)
    for (auto& x : row) x = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec k[V];
    for (int64_t v = 0; v < V; ++v) k[v] = Vec::loadu(keys_t + d * kBlock + v * Vec::size());
    for (int64_t r = 0; r < kRows; ++r) {
      const Vec qd(qf[qrow[r] * D + d]);
      for (int64_t v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(qd, k[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v].store(score + qrow[r] * kBlock + v * Vec::size());
}

template <int64_t kD>
void score_all(const float* qf, const int64_t* qrow, int64_t rows, const float* keys_t, int64_t dim, float* score) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) score_rows<4, kD>(qf, qrow + r, keys_t, dim, score);
  switch (rows - r) {
    case 3: score_rows<3, kD>(qf, qrow + r, keys_t, dim, score); break;
    case 2: score_rows<2, kD>(qf, qrow + r, keys_t, dim, score); break;
    case 1: score_rows<1, kD>(qf, qrow + r, keys_t, dim, score); break;
    default: break;
  }
}

// outs[r][0, kD) += sum_j ps[r][j] * values[j * W, + kD) for kRows rows that read the same values:
// each value row is loaded once for all of them; the accumulators stay in registers.
template <int64_t kRows, int64_t kD>
inline void accumulate_rows(float* const* outs, const float* const* ps, const float* values, int64_t W, int64_t n) {
  constexpr int64_t V = kD / Vec::size();
  Vec a[kRows][V];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < V; ++v) a[r][v] = Vec::loadu(outs[r] + v * Vec::size());
  for (int64_t j = 0; j < n; ++j) {
    Vec x[V];
    for (int64_t v = 0; v < V; ++v) x[v] = Vec::loadu(values + j * W + v * Vec::size());
    for (int64_t r = 0; r < kRows; ++r) {
      const Vec pj(ps[r][j]);
      for (int64_t v = 0; v < V; ++v) a[r][v] = at::vec::fmadd(pj, x[v], a[r][v]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t v = 0; v < V; ++v) a[r][v].store(outs[r] + v * Vec::size());
}

template <int64_t kD>
void accumulate_all(float* const* outs, const float* const* ps, int64_t rows, const float* values, int64_t W,
                    int64_t n) {
  // At most ~24 accumulator registers: 4 rows of 64 floats, 2 of 128.
  constexpr int64_t kRows = kD <= 64 ? 4 : 2;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) accumulate_rows<kRows, kD>(outs + r, ps + r, values, W, n);
  for (; r < rows; ++r) accumulate_rows<1, kD>(outs + r, ps + r, values, W, n);
}

// One task: keys [lo, hi) of the R rows reqs[0, R), whose slots are the same over that range
// (R > 1: a prompt prefix they share through the radix cache, or the tokens of one extend), every
// head; row r reads keys up to min(hi, seq_lens[reqs[r]]), ascending in r (the tokens of an extend
// read nested runs: each the previous one and its own key). Writes, per request r
// and query head i, parts[r][i] = {max score, sum of exp(score - max), sum of exp(score - max) *
// value[0, dim)}. A block of keys is read as whole pool rows (every KV head of a slot, contiguous),
// converted to float once for all R requests; per KV head its keys are transposed ([dim, kBlock]) so
// that the scores of the block for one query are kBlock-wide vector FMAs (no horizontal sum per
// score); the value rows are converted once and added into each query's accumulator. The next
// block's rows are prefetched. kD: the head dim when it is known at compile time (its loops then
// unroll), else 0.
template <typename Q, typename KV, int64_t kD>
void attend_chunk(const Shape& s, const Q* q, const KV* k_buf, const KV* v_buf, float k_scale, float v_scale,
                  const int64_t* const* slots, const int32_t* seq_lens, const int64_t* reqs, int64_t R, int64_t lo,
                  int64_t hi, float scale, float cap, float* const* parts, std::vector<float>& scratch) {
  const int64_t G = s.group, D = kD ? kD : s.dim, H = s.heads, W = s.kv_heads * D;  // W: a slot's row
  const int64_t RH = R * H;  // query rows: request r's head i is row r * H + i
  scratch.resize(RH * D + kBlock * W + kBlock * D + RH * kBlock + 2 * RH);
  float* qf = scratch.data();           // [RH, D], pre-scaled
  float* rows = qf + RH * D;            // [kBlock, W]: the block's key rows, then its value rows
  float* keys_t = rows + kBlock * W;    // [D, kBlock]: one KV head's keys
  float* score = keys_t + kBlock * D;   // [RH, kBlock]
  float* mx = score + RH * kBlock;      // [RH]
  float* sum = mx + RH;                 // [RH]
  for (int64_t r = 0; r < R; ++r) {
    to_float(q + reqs[r] * H * D, qf + r * H * D, H * D, scale);
    for (int64_t i = 0; i < H; ++i) std::fill_n(parts[r] + i * (D + 2) + 2, D, 0.f);
  }
  std::fill_n(mx, RH, -std::numeric_limits<float>::infinity());
  std::fill_n(sum, RH, 0.f);
  const int64_t* row_slots = slots[reqs[R - 1]];  // the row reading the most keys
  // Per KV head, the query rows that read it (request r's heads h * G .. (h + 1) * G), in order.
  std::vector<int64_t> head_rows(RH);
  for (int64_t h = 0, k = 0; h < s.kv_heads; ++h)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < G; ++g) head_rows[k++] = r * H + h * G + g;
  std::vector<float*> out_row(RH), outs(R * G);  // a query row's accumulator (its partial's values)
  std::vector<const float*> ps(R * G);
  for (int64_t i = 0; i < RH; ++i) out_row[i] = parts[i / H] + (i % H) * (D + 2) + 2;
  std::vector<int64_t> ends(R);  // row r's keys end here (ascending)
  for (int64_t r = 0; r < R; ++r) ends[r] = std::min<int64_t>(hi, seq_lens[reqs[r]]);
  int64_t first = 0;  // rows [first, R) read the block: the others' keys ended before it
  for (int64_t l0 = lo; l0 < hi; l0 += kBlock) {
    const int64_t n = std::min(kBlock, hi - l0);
    while (ends[first] <= l0) ++first;
    const int64_t active = (R - first) * G;  // of each KV head's query rows, the last `active` read the block
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
      const int64_t* hr = head_rows.data() + h * R * G + first * G;
      score_all<kD>(qf, hr, active, keys_t, D, score);
      for (int64_t k = 0; k < active; ++k) {
        const int64_t i = hr[k];
        float* si = score + i * kBlock;
        if (cap > 0.f) {
          for (int64_t v = 0; v < kBlock / Vec::size(); ++v) {
            const Vec x = Vec::loadu(si + v * Vec::size());
            (Vec(cap) * (x / Vec(cap)).tanh()).store(si + v * Vec::size());
          }
        }
        const int64_t seen = ends[i / H] - l0;  // >= 1: the row's keys in the block (after the cap: tanh(-inf) is finite)
        if (seen < n) std::fill(si + seen, si + n, -std::numeric_limits<float>::infinity());
        const float m = std::max(mx[i], *std::max_element(si, si + n));
        if (m > mx[i] && l0 > lo) {  // the weights so far were relative to a smaller max
          const float corr = std::exp(mx[i] - m);
          sum[i] *= corr;
          rescale(out_row[i], corr, D);
        }
        mx[i] = m;
        sum[i] += exp_sum(si, m, n);
      }
    }
    for (int64_t j = 0; j < n; ++j) to_float(v_buf + row_slots[l0 + j] * W, rows + j * W, W, v_scale);
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t* hr = head_rows.data() + h * R * G + first * G;
      const float* values = rows + h * D;
      for (int64_t k = 0; k < active; ++k) {
        outs[k] = out_row[hr[k]];
        ps[k] = score + hr[k] * kBlock;  // (a key past the row's end: weight exp(-inf) = 0)
      }
      if constexpr (kD > 0 && kD % Vec::size() == 0) {
        accumulate_all<kD>(outs.data(), ps.data(), active, values, W, n);
      } else {
        for (int64_t k = 0; k < active; ++k)
          for (int64_t j = 0; j < n; ++j) add_scaled(outs[k], ps[k][j], values + j * W, D);
      }
    }
  }
  for (int64_t i = 0; i < RH; ++i) {
    parts[i / H][(i % H) * (D + 2)] = mx[i];
    parts[i / H][(i % H) * (D + 2) + 1] = sum[i];
  }
}

// Keys [lo, hi) of rows order[first, first + count), whose slots are the same there (each row reading
// them up to its own end, ascending); their partial results go to partials [part, part + count).
struct Task {
  int64_t lo, hi, first, count, part, cost;  // cost: keys x the rows reading them
};

// The tasks of a batch. Rows are ordered by their first visible key's slot; consecutive ones with
// the same first key and slot form a group. A group whose rows' keys nest (each row's slots a prefix
// of the longest row's: the tokens of one extend) is one range read by its rows causally. Otherwise
// the group's common run of slots (a prompt prefix shared through the radix cache) is one range read
// once for all its rows, and after it each row's keys are its own range, save that rows whose keys
// after the run nest (one request's extend tokens past a shared prefix) form a nested range again.
// A range of one row or a shared run is cut into key chunks of about `cost_per_task` key-queries
// (keys x the rows reading them), none shorter than kMinChunk keys; a nested range into runs of rows
// of about that cost (each reads the keys up to its last row's end).
std::vector<Task> plan_tasks(const Shape& s, const int64_t* const* slots, const int32_t* seq_lens, const int32_t* first_key,
                             int64_t threads, std::vector<int64_t>& order) {
  order.resize(s.bs);
  std::iota(order.begin(), order.end(), 0);
  const auto keys = [&](int64_t b) { return std::max<int64_t>(0, seq_lens[b] - first_key[b]); };
  const auto row = [&](int64_t b) { return slots[b]; };
  const auto lead = [&](int64_t b) { return keys(b) > 0 ? row(b)[first_key[b]] : -1; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::make_pair(first_key[a], lead(a)) < std::make_pair(first_key[b], lead(b));
  });
  struct Range {
    int64_t lo, hi, first, count;
    bool nested;
  };
  std::vector<Range> ranges;
  // Rows order[g, end) (ascending keys) from key lo on: a nested range if each row's slots there are
  // a prefix of the last row's, else false. Where the keys all rows read are kMinChunk or more (a
  // verify's drafts over a long context, a prompt's later chunk), they are a shared range of their
  // own, so that they can be cut into chunks of keys as a shared prefix is.
  const auto nest = [&](int64_t g, int64_t end, int64_t lo) {
    const int64_t* longest = row(order[end - 1]);
    for (int64_t m = g; m + 1 < end; ++m) {
      const int64_t b = order[m];
      if (!std::equal(row(b) + lo, row(b) + seq_lens[b], longest + lo)) return false;
    }
    const int64_t common = seq_lens[order[g]];
    if (common - lo >= kMinChunk) {
      ranges.push_back({lo, common, g, end - g, false});
      lo = common;
      while (g < end && seq_lens[order[g]] <= lo) ++g;  // rows with no keys after the common ones
    }
    if (g < end) ranges.push_back({lo, seq_lens[order[end - 1]], g, end - g, g + 1 < end});
    return true;
  };
  int64_t total = 0;
  for (int64_t g = 0; g < s.bs;) {
    const int64_t a = order[g], lo = first_key[a];
    int64_t end = g + 1;
    while (end < s.bs && keys(a) > 0 && first_key[order[end]] == lo && lead(order[end]) == lead(a)) ++end;
    for (int64_t m = g; m < end; ++m) total += keys(order[m]);
    const auto by_keys = [&](int64_t x, int64_t y) { return keys(x) < keys(y); };
    std::stable_sort(order.begin() + g, order.begin() + end, by_keys);
    if (end - g == 1 || nest(g, end, lo)) {
      if (end - g == 1) ranges.push_back({lo, std::max<int64_t>(lo, seq_lens[a]), g, 1, false});
      g = end;
      continue;
    }
    int64_t shared = keys(order[g]);  // the common run: at most the fewest keys
    for (int64_t m = g + 1; m < end; ++m)
      shared = std::mismatch(row(order[g]) + lo, row(order[g]) + lo + shared, row(order[m]) + lo).first - row(order[g]) - lo;
    const int64_t after = lo + shared;
    ranges.push_back({lo, after, g, end - g, false});
    // After the run: rows with keys left, by their next slot (then keys); equal next slots may nest.
    const auto next = [&](int64_t b) { return seq_lens[b] > after ? row(b)[after] : -1; };
    std::stable_sort(order.begin() + g, order.begin() + end, [&](int64_t x, int64_t y) {
      return std::make_pair(next(x), keys(x)) < std::make_pair(next(y), keys(y));
    });
    for (int64_t m = g; m < end;) {
      int64_t e = m + 1;
      while (e < end && next(order[e]) == next(order[m])) ++e;
      if (next(order[m]) >= 0 && (e - m == 1 || !nest(m, e, after)))
        for (int64_t k = m; k < e; ++k) ranges.push_back({after, seq_lens[order[k]], k, 1, false});
      m = e;
    }
    g = end;
  }
  const int64_t cost_per_task = std::max(kMinChunk, (total + kTasksPerThread * threads - 1) / (kTasksPerThread * threads));
  std::vector<Task> tasks;
  int64_t part = 0;
  for (const Range& r : ranges) {
    if (r.nested) {  // runs of rows, each reading keys up to its last row's end
      for (int64_t m = r.first, cost = 0, from = r.first; m < r.first + r.count; ++m) {
        cost += seq_lens[order[m]] - r.lo;
        if (cost >= cost_per_task || m + 1 == r.first + r.count) {
          tasks.push_back({r.lo, seq_lens[order[m]], from, m + 1 - from, part, cost});
          part += m + 1 - from;
          from = m + 1;
          cost = 0;
        }
      }
      continue;
    }
    const int64_t len = r.hi - r.lo;
    const int64_t pieces = std::max<int64_t>(1, std::min((len * r.count) / cost_per_task, len / kMinChunk));
    const int64_t per = (len + pieces - 1) / pieces;
    for (int64_t p = 0; p < pieces; ++p) {  // (an empty range: one empty task, its partial skipped)
      const int64_t lo = std::min(r.hi, r.lo + p * per), hi = std::min(r.hi, lo + per);
      tasks.push_back({lo, hi, r.first, r.count, part, (hi - lo + 1) * r.count});
      part += r.count;
    }
  }
  return tasks;
}

template <typename Q, typename KV, int64_t kD>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, float k_scale,
         float v_scale, const std::vector<const int64_t*>& sp, const int32_t* seq_lens, const int32_t* first_key,
         const float* sinks, float scale, float cap, at::Tensor& out) {
  const int64_t D = s.dim, H = s.heads;
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> order;
  const std::vector<Task> tasks = plan_tasks(s, sp.data(), seq_lens, first_key, threads, order);
  const int64_t part_size = H * (D + 2);
  const int64_t num_parts = tasks.empty() ? 0 : tasks.back().part + tasks.back().count;
  std::vector<float> parts(num_parts * part_size);
  std::vector<std::vector<int64_t>> req_parts(s.bs);  // request b's partial results
  for (const Task& t : tasks)
    for (int64_t r = 0; r < t.count; ++r) req_parts[order[t.first + r]].push_back(t.part + r);
  // Threads take contiguous runs of tasks of about equal cost (a group's task costs its requests'
  // count times a single one's): at::parallel_for over the threads, each its own run.
  std::vector<int64_t> bound(threads + 1, int64_t(tasks.size()));
  {
    int64_t total = 0, acc = 0;
    for (const Task& t : tasks) total += t.cost;
    int64_t th = 1;
    bound[0] = 0;
    for (int64_t i = 0; i < int64_t(tasks.size()) && th < threads; ++i) {
      acc += tasks[i].cost;
      while (th < threads && acc * threads >= th * total) bound[th++] = i + 1;
    }
  }
  const Q* qp = q.const_data_ptr<Q>();
  const KV* kp = k_buf.const_data_ptr<KV>();
  const KV* vp = v_buf.const_data_ptr<KV>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<float*> out_parts;
    for (int64_t th = begin; th < end; ++th) {
      for (int64_t i = bound[th]; i < bound[th + 1]; ++i) {
        const Task& t = tasks[i];
        out_parts.resize(t.count);
        for (int64_t r = 0; r < t.count; ++r) out_parts[r] = parts.data() + (t.part + r) * part_size;
        attend_chunk<Q, KV, kD>(s, qp, kp, vp, k_scale, v_scale, sp.data(), seq_lens, order.data() + t.first, t.count,
                                t.lo, t.hi, scale, cap, out_parts.data(), scratch);
      }
    }
  });
  Q* op = out.data_ptr<Q>();
  at::parallel_for(0, s.bs * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, head = i % H;
      float m = sinks[head];
      for (const int64_t c : req_parts[b]) m = std::max(m, parts[c * part_size + head * (D + 2)]);
      float total = std::isinf(sinks[head]) ? 0.f : std::exp(sinks[head] - m);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (const int64_t c : req_parts[b]) {
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
  const at::Tensor &q, &k_buf, &v_buf;
  const std::vector<const int64_t*>& slots;  // row b's keys' slots (a row of the slots table)
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
                                  const at::Tensor& slot_rows, const at::Tensor& seq_lens, const at::Tensor& first_key, const at::Tensor& sinks,
                                  double scale, std::optional<double> cap) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(), "q [bs, H, D], k/v [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "contiguous q and pool buffers");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.stride(1) == 1, "slots int64 [n, L]");
  TORCH_CHECK(slot_rows.scalar_type() == at::kLong && slot_rows.dim() == 1, "slot_rows int64 [bs]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && first_key.scalar_type() == at::kInt, "int32 seq_lens, first_key");
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == q.size(1), "float32 sinks, one per head");
  const Shape s{q.size(0), q.size(1), k_buf.size(1), q.size(1) / k_buf.size(1), q.size(2)};
  TORCH_CHECK(s.group * s.kv_heads == s.heads && k_buf.size(2) == s.dim, "head shapes");
  TORCH_CHECK(slot_rows.numel() == s.bs && seq_lens.numel() == s.bs && first_key.numel() == s.bs, "one entry per row");
  auto seq = seq_lens.contiguous(), first = first_key.contiguous(), sk = sinks.contiguous(), rows = slot_rows.contiguous();
  std::vector<const int64_t*> row_slots(s.bs);
  const int64_t* table = slots.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < s.bs; ++b) {
    const int64_t r = rows.const_data_ptr<int64_t>()[b];
    TORCH_CHECK(0 <= r && r < slots.size(0), "slot_rows[", b, "] = ", r, " outside the slots table");
    TORCH_CHECK(seq.const_data_ptr<int32_t>()[b] <= slots.size(1), "seq_lens[", b, "] past the slots table");
    row_slots[b] = table + r * slots.stride(0);
  }
  auto out = at::empty(q.sizes(), q.options());
  const float ks = k_scale.item<float>(), vs = v_scale.item<float>(), c = cap.has_value() ? float(*cap) : 0.f;
  const Args a{q, k_buf, v_buf, row_slots, ks, vs, seq.const_data_ptr<int32_t>(), first.const_data_ptr<int32_t>(),
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
      "Tensor slot_rows, Tensor seq_lens, Tensor first_key, Tensor sinks, float scale, float? cap) -> Tensor");
}

TORCH_LIBRARY_IMPL(rxf_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
