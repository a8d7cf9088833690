// Paged decode attention: a decode step's queries against their sequences' cache blocks.
#include "vec.h"
#include "kernels.h"

// The keys of the thread's next decode-attention task, or none (k null). A task reads its keys (QK, its values fetched
// into L2 meanwhile), then its values (PV) from L2: during PV the memory idled, so PV fetches the next task's keys into
// L2 as it goes, as far as its own context reaches. On an Emerald Rapids with the cache in memory (more than its L3:
// benchmarks/paged_decode.py --layers 64), 64 streams of 192 positions ran 1.13x as fast in bf16, fp32 1.11-1.14x at
// 32-64, 1.11-1.13x in AVX2 code, 1.07-1.16x in attend_bf16 (cooperlake code); unchanged where the cache fits L3. The
// engine's bf16 decode 1.055x / 1.058x at 32 / 64 streams (benchmarks/results/engine-ahead-ab-emr.json).
// k: the keys of the KV head the PV at hand reads (a PV fetches as many bytes a key as it reads a value).
struct Ahead { const void* k = nullptr; const int64_t* blocks = nullptr; int64_t len = 0; };

#ifdef INFERD_VEC

// The next task's keys in the block at t0 (null: none). PV fetches them into L2 a key at a time, between its own
// loads: a block's keys at once at its start left the time unchanged, and so did a test per key of whether it was
// one its pass should fetch.
template <typename T>
static inline const T* ahead_keys(const Ahead& a, int64_t t0, int64_t block_size, int64_t row) {
  return a.k && t0 < a.len ? (const T*)a.k + a.blocks[t0 / block_size] * block_size * row : nullptr;
}

// the scores of GT query heads (q: their rows, float32, scaled) against one sequence's keys, for one KV head:
// s[g * stride + t]
template <int C, int GT, typename T>
static void qk_tile(const float* q, int64_t hd, const T* cache, const T* vcache, const int64_t* blocks,
                    int64_t block_size, int64_t row, int64_t len, float* s, int64_t stride) {
  vec qv[GT][C];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = vload(q + g * hd + c * W);
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const T* block = cache + blocks[t0 / block_size] * block_size * row;
    const int64_t n = std::min(block_size, len - t0);
    // a head's row is hd * sizeof(T) bytes of every KVH times as many, in blocks anywhere: the next block's keys are
    // fetched ahead, and this one's values into L2 for pv_tile
    const T* next = t0 + block_size < len ? cache + blocks[t0 / block_size + 1] * block_size * row : nullptr;
    const T* values = vcache + blocks[t0 / block_size] * block_size * row;
    for (int64_t i = 0; i < n; ++i) {
      const T* k = block + i * row;
      if (next) prefetch<_MM_HINT_T0>(next + i * row, C * W * sizeof(T));
      prefetch<_MM_HINT_T1>(values + i * row, C * W * sizeof(T));
      vec kv[C];
      for (int c = 0; c < C; ++c) kv[c] = vload(k + c * W);
      for (int g = 0; g < GT; ++g) {
        vec acc = vmul(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = vfma(qv[g][c], kv[c], acc);
        s[g * stride + t0 + i] = vsum(acc);
      }
    }
  }
}

// out[g] = sum_t p[g * stride + t] v_t for GT query heads, then times inv[g]; the next task's keys fetched (Ahead)
template <int C, int GT, typename T>
static void pv_tile(const float* p, int64_t stride, const T* cache, const int64_t* blocks, int64_t block_size,
                    int64_t row, int64_t len, const float* inv, float* out, int64_t hd, const Ahead& ahead) {
  vec acc[GT][C];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = vset(0.f);
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const T* block = cache + blocks[t0 / block_size] * block_size * row;
    const int64_t n = std::min(block_size, len - t0);
    const T* keys = ahead_keys<T>(ahead, t0, block_size, row);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = block + i * row;
      if (keys) prefetch<_MM_HINT_T1>(keys + i * row, C * W * sizeof(T));
      vec vv[C];
      for (int c = 0; c < C; ++c) vv[c] = vload(v + c * W);
      for (int g = 0; g < GT; ++g) {
        const vec w = vset(p[g * stride + t0 + i]);
        for (int c = 0; c < C; ++c) acc[g][c] = vfma(w, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) vstore(out + g * hd + c * W, vmul(acc[g][c], vset(inv[g])));
}

// softmax's numerators in place, returning their sum; the row's max in *max
static float exp_row(float* s, int64_t len, float* max) {
  vec m = vset(-std::numeric_limits<float>::max());
  int64_t t = 0;
  for (; t + W <= len; t += W) m = vmax(m, vload(s + t));
  float mx = vhmax(m);
  for (; t < len; ++t) mx = std::max(mx, s[t]);
  vec sum = vset(0.f);
  for (t = 0; t + W <= len; t += W) { const vec e = vexp(vadd(vload(s + t), vset(-mx))); vstore(s + t, e); sum = vadd(sum, e); }
  float total = vsum(sum);
  for (; t < len; ++t) { s[t] = std::exp(s[t] - mx); total += s[t]; }
  *max = mx;
  return total;
}

// one (sequence, KV head): its G query heads in tiles of up to 4, for head_dim C vectors; each head's scores' max
// and the sum of their exponentials into stats[2 g], stats[2 g + 1] (merge_parts)
template <int C, typename T>
static void attend_vec(const float* qf, int64_t G, int64_t hd, const T* kc, const T* vc, const int64_t* blocks,
                       int64_t block_size, int64_t row, int64_t len, float* scores, int64_t stride, float* out,
                       float* stats, const Ahead& next) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gt = std::min<int64_t>(4, G - g0);
    const float* q = qf + g0 * hd; float* s = scores + g0 * stride;
    switch (gt) {
      case 1: qk_tile<C, 1>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      case 2: qk_tile<C, 2>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      case 3: qk_tile<C, 3>(q, hd, kc, vc, blocks, block_size, row, len, s, stride); break;
      default: qk_tile<C, 4>(q, hd, kc, vc, blocks, block_size, row, len, s, stride);
    }
    float inv[4];
    for (int64_t g = 0; g < gt; ++g) {
      float* st = stats + 2 * (g0 + g);
      st[1] = exp_row(s + g * stride, len, &st[0]);
      inv[g] = 1.f / st[1];
    }
    float* o = out + g0 * hd;
    const Ahead ahead = g0 == 0 ? next : Ahead{};  // the first tile's PV fetches them
    switch (gt) {
      case 1: pv_tile<C, 1>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      case 2: pv_tile<C, 2>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      case 3: pv_tile<C, 3>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead); break;
      default: pv_tile<C, 4>(s, stride, vc, blocks, block_size, row, len, inv, o, hd, ahead);
    }
  }
}


#include "decode_attention_avx512.h"  // bf16 on AVX-512: attend_split, attend_bf16
#endif  // INFERD_VEC


// the same on scalars, for any head_dim
template <typename T>
static void attend_scalar(const float* qf, int64_t G, int64_t hd, const T* kc, const T* vc, const int64_t* blocks,
                          int64_t block_size, int64_t row, int64_t len, float* scores, int64_t stride, float* out,
                          float* stats, const Ahead&) {
  for (int64_t t = 0; t < len; ++t) {
    const T* k = kc + blocks[t / block_size] * block_size * row + (t % block_size) * row;
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t i = 0; i < hd; ++i) dot += qf[g * hd + i] * ld(k[i]);
      scores[g * stride + t] = dot;
    }
  }
  std::fill(out, out + G * hd, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    const float mx = *std::max_element(s, s + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
    stats[2 * g] = mx;
    stats[2 * g + 1] = sum;
    for (int64_t t = 0; t < len; ++t) {
      const T* v = vc + blocks[t / block_size] * block_size * row + (t % block_size) * row;
      const float w = s[t] / sum;
      for (int64_t i = 0; i < hd; ++i) out[g * hd + i] += w * ld(v[i]);
    }
  }
}

// A (sequence, KV head)'s attention over parts of its context, each part's output normalized on its own: the whole's,
// in float32: each part weighs the sum of its exponentials, rescaled to the largest max (stats as attend_* write them)
static void merge_parts(const float* outs, const float* stats, int64_t parts, int64_t G, int64_t hd, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, stats[p * 2 * G + 2 * g]);
    std::fill(out + g * hd, out + (g + 1) * hd, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float w = stats[p * 2 * G + 2 * g + 1] * std::exp(stats[p * 2 * G + 2 * g] - mx);
      total += w;
      for (int64_t i = 0; i < hd; ++i) out[g * hd + i] += w * outs[p * G * hd + g * hd + i];
    }
    for (int64_t i = 0; i < hd; ++i) out[g * hd + i] /= total;
  }
}

using AttendBf16 = void (*)(const bf16*, float, int64_t, int64_t, int64_t, const bf16*, const bf16*, const int64_t*,
                           int64_t, int64_t, int64_t, float*, bf16*, int64_t, float*, float*, const Ahead&);

// positions a part of one sequence's context holds at least, where paged_decode cuts a context in parts
constexpr int64_t MIN_PART = 128;

// q: [D, H, hd]; k_cache, v_cache: [slots, KVH, hd]; block_tables: [D, nb] int64; context_lens: [D] int64.
// Tasks: a (sequence, KV head) each (attend_bf16's: a sequence each, all its KV heads), split across the threads.
// Where those are fewer than twice the threads (one sequence of SmolLM2's 3 KV heads on 2 cores: 2 tasks on one
// thread, 1 on the other), each context is cut into parts of whole blocks, at least MIN_PART positions each, attended
// separately and merged (merge_parts).
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2)
              && q.size(1) % k_cache.size(1) == 0, "q: [D, H, hd], caches: [slots, KVH, hd] with KVH dividing H");
  check(q, q, "q"); check(k_cache, q, "k_cache"); check(v_cache, q, "v_cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong
              && block_tables.is_contiguous() && context_lens.is_contiguous(), "int64 block tables and lengths");
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == D && context_lens.numel() == D,
              "a block table and a context length per query");
  const int64_t G = H / KVH, nb = block_tables.size(1);
  auto out = at::empty_like(q);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t row = KVH * hd;  // elements per cache slot
  const int64_t num_blocks = k_cache.size(0) / block_size;
  int64_t longest = 0;
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(0 < lens[d] && lens[d] <= nb * block_size, "context length out of range");
    for (int64_t b = 0; b < (lens[d] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(0 <= bt[d * nb + b] && bt[d * nb + b] < num_blocks, "block id out of range");
    longest = std::max(longest, lens[d]);
  }
  by_dtype(q, [&](auto z) {
    using T = decltype(z);
    auto attend = attend_scalar<T>;
    bool split = false;  // qf in split_q's order (attend_split)
#ifdef INFERD_VEC
    if (hd == W) attend = attend_vec<1, T>;
    else if (hd == 2 * W) attend = attend_vec<2, T>;
    else if (hd == 4 * W) attend = attend_vec<4, T>;
    else if (hd == 8 * W) attend = attend_vec<8, T>;
    else if (hd == 16 * W) attend = attend_vec<16, T>;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>) {
      const auto to = hd == 32 ? attend_split<1> : hd == 64 ? attend_split<2> : hd == 128 ? attend_split<4> : nullptr;
      if (to) attend = to, split = true;
    }
#endif
#endif
    // bf16 on its dot products where the CPU has them and the sequences alone keep the threads busy (attend_bf16, a
    // task a sequence: all its KV heads), else widened to float32 (attend, a task a KV head). With fewer sequences
    // (cut in parts, below) the dot products were 1.25x the time at one stream of 512 positions. Not where the CPU has
    // AMX (Intel's cores: their 512-bit shuffles, sum16's, all go to one port): on an Emerald Rapids they took
    // 1.16-1.34x the widened loops' time at 8-64 streams (benchmarks/results/paged-decode-emr.json).
    const int64_t threads = at::get_num_threads();
    AttendBf16 attend2 = nullptr;
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (D >= 2 * threads)
        attend2 = hd == 32 ? attend_bf16<1> : hd == 64 ? attend_bf16<2> : hd == 128 ? attend_bf16<4> : nullptr;
    }
#endif
    const int64_t KH = attend2 ? KVH : 1, groups = KVH / KH, HG = KH * G;  // KV heads a task, tasks a sequence
    const T *qp = ptr<T>(q), *kp = ptr<T>(k_cache), *vp = ptr<T>(v_cache); T* op = ptr<T>(out);
    const int64_t want = D * groups < 2 * threads ? (2 * threads + D * groups - 1) / (D * groups) : 1;  // parts a context
    struct Part { int64_t d, h, t0, t1; };
    std::vector<Part> parts;
    std::vector<int64_t> first(D * groups + 1);  // (d, group)'s parts: first[d * groups + group] ..
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < groups; ++j) {
        first[d * groups + j] = parts.size();
        const int64_t n = std::max<int64_t>(1, std::min(want, lens[d] / MIN_PART));
        for (int64_t p = 0, t0 = 0; p < n; ++p) {
          const int64_t t1 = p + 1 == n ? lens[d] : lens[d] * (p + 1) / n / block_size * block_size;
          if (t1 > t0) parts.push_back({d, j * KH, t0, t1}), t0 = t1;
        }
      }
    first[D * groups] = parts.size();
    const bool cut = (int64_t)parts.size() > D * groups;
    std::vector<float> outs(cut ? parts.size() * HG * hd : 0), stats(cut ? parts.size() * 2 * HG : 0);
    auto store = [&](int64_t d, int64_t h, const float* o) {
      T* og = op + (d * H + h * G) * hd;
      for (int64_t i = 0; i < HG * hd; ++i) og[i] = to<T>(o[i]);
    };
    at::parallel_for(0, parts.size(), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(HG * longest), qf(G * hd), acc(HG * hd), st(2 * HG);
      std::vector<bf16> probs(attend2 ? G * longest : 0);  // a PV tile's heads, at most G
      for (int64_t i = begin; i < end; ++i) {
        const auto [d, h, t0, t1] = parts[i];
        const T* qg = qp + (d * H + h * G) * hd;
        float *o = cut ? &outs[i * HG * hd] : acc.data(), *sti = cut ? &stats[i * 2 * HG] : st.data();
        const int64_t* blocks = bt + d * nb + t0 / block_size;
        Ahead next;
        if (i + 1 < end) {
          const Part& nx = parts[i + 1];  // the thread's next task
          next = Ahead{kp + nx.h * hd, bt + nx.d * nb + nx.t0 / block_size, nx.t1 - nx.t0};
        }
        if (attend2) {
          attend2((const bf16*)qg, (float)scale, KH, G, hd, (const bf16*)kp + h * hd, (const bf16*)vp + h * hd, blocks,
                  block_size, row, t1 - t0, scores.data(), probs.data(), longest, o, sti, next);
        } else {
          if (split) {
#if defined(__AVX512F__)
            split_q((const bf16*)qg, (float)scale, G * hd, qf.data());
#endif
          } else {
            for (int64_t j = 0; j < G * hd; ++j) qf[j] = ld(qg[j]) * (float)scale;
          }
          attend(qf.data(), G, hd, kp + h * hd, vp + h * hd, blocks, block_size, row, t1 - t0, scores.data(), longest,
                 o, sti, next);
        }
        if (!cut) store(d, h, acc.data());
      }
    });
    if (cut) {
      std::vector<float> acc(HG * hd);
      for (int64_t task = 0; task < D * groups; ++task) {
        const int64_t p = first[task], n = first[task + 1] - p;
        merge_parts(&outs[p * HG * hd], &stats[p * 2 * HG], n, HG, hd, acc.data());
        store(task / groups, task % groups * KH, acc.data());
      }
    }
  });
  return out;
}

