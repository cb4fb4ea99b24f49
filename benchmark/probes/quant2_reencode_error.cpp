// SPDX-License-Identifier: Apache-2.0
// Probe (issue 20, docs/eviction-design.md): the attention error of a quant2 cache against fp64
// exact attention over the survivors, before and after a repack that re-encodes the pages it
// writes. Host only, not part of the build:
//   g++ -std=c++17 -O2 -I include -isystem /usr/include/eigen3 benchmark/probes/quant2_reencode_error.cpp -o /tmp/q2 && /tmp/q2
#include <cstdio>
#include <random>
#include <cmath>
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"
#include "../../test/support/oracle.hpp"
#include "../../test/support/feed.hpp"
using namespace kvmosaic;
template <class Cache> std::vector<float> att(Cache& kv, sequence_id seq, const std::vector<float>& q) {
  const cache_config& c = kv.config(); const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> out(q.size()); const sequence_id one[] = {seq};
  kv.attend(span<const sequence_id>(one,1), tensor_view<const float,3>(q.data(),1,hq,d), tensor_view<float,3>(out.data(),1,hq,d));
  return out; }
int main() {
  cache_config c; c.num_kv_heads=2; c.group_size=4; c.head_dim=128; c.page_size=64; c.max_pages=256; c.max_sequences=2;
  for (auto rounding : {format::rounding::stochastic, format::rounding::nearest})
  for (double frac : {0.5, 0.9}) {
    double e_before=0, e_after=0, e_after2=0; int trials=8;
    for (int trial=0; trial<trials; ++trial) {
    const int tokens=4096;
    auto data = synthetic::generate_kv(test::generator_for(c, 100+trial), 0, tokens);
    format::quant2 f; f.partition=64; f.mode=rounding;
    cache<format::quant2, select::all, compact::repack> kv(c, f);
    auto seq = kv.add_sequence(); kv.prefill(seq, test::k_view(data), test::v_view(data));
    std::mt19937_64 rng(trial); std::vector<std::int64_t> dead;
    for (std::int64_t t=0;t<tokens-64;++t) if (std::bernoulli_distribution(frac)(rng)) dead.push_back(t);
    kv.evict(seq, span<const std::int64_t>(dead.data(), (std::int64_t)dead.size()));
    const std::size_t row = (std::size_t)c.num_kv_heads*c.head_dim;
    synthetic::kv_data kept=data; kept.k.clear(); kept.v.clear();
    for (std::int64_t t=0;t<tokens;++t){ if (std::binary_search(dead.begin(),dead.end(),t)) continue;
      kept.k.insert(kept.k.end(), data.k.begin()+t*row, data.k.begin()+(t+1)*row); kept.v.insert(kept.v.end(), data.v.begin()+t*row, data.v.begin()+(t+1)*row);}
    kept.num_tokens = (int)(kept.k.size()/row);
    std::vector<float> q(c.num_q_heads()*c.head_dim); for (size_t i=0;i<q.size();++i) q[i]=std::sin(0.3f*i)*2;
    auto ex = test::exact(q, kept, 1.0/std::sqrt(128.0));
    auto rel=[&](const std::vector<float>& o){ double n=0,dn=0; for(size_t i=0;i<o.size();++i){n+=(o[i]-ex[i])*(o[i]-ex[i]); dn+=ex[i]*ex[i];} return std::sqrt(n/dn);};
    e_before += rel(att(kv,seq,q));
    kv.compact(seq); e_after += rel(att(kv,seq,q));
    // a second round: evict more then compact again
    std::vector<std::int64_t> pos = kv.positions(seq); std::vector<std::int64_t> more;
    for (size_t i=0;i+64<pos.size();i+=7) if (pos[i]>=0) more.push_back(pos[i]);
    kv.evict(seq, span<const std::int64_t>(more.data(), (std::int64_t)more.size()));
    }
    std::printf("%s evict %.0f%%: rel L2 err first encode %.4f, after repack re-encode %.4f\n", rounding==format::rounding::stochastic?"stochastic":"nearest", frac*100, e_before/trials, e_after/trials);
  }
}
