// Hierarchical all-reduce: reduce inside each node, all-reduce across nodes,
// broadcast back inside each node.
//
//  1. Members are grouped by node (node_of[i]); the lowest member of each
//     group is its leader. Each group reduces to its leader with a binomial
//     tree (intra-node links are the cheap ones).
//  2. The leaders, one per node, all-reduce among themselves: the ring for
//     messages above auto_small_message_bytes, halving-doubling below it.
//  3. Each leader broadcasts the result inside its group (binomial tree).
// Only one buffer per node crosses the network in step 2, instead of one per
// member.

#include <algorithm>
#include <map>

#include "allreduce/algorithm.h"

namespace diststrat {
namespace algo {

void hierarchical_all_reduce(const Peers& peers, const AllReduceArgs& a,
                             const std::vector<int>& node_of) {
  const int n = peers.size();
  DISTSTRAT_CHECK_EQ(static_cast<int>(node_of.size()), n, "hierarchical all-reduce node map");
  std::map<int, std::vector<int>> groups;  // node -> members, ascending
  for (int i = 0; i < n; ++i) groups[node_of[i]].push_back(i);

  Peers local;
  local.transport = peers.transport;
  Peers leaders;
  leaders.transport = peers.transport;
  for (const auto& [node, members] : groups) {
    leaders.ranks.push_back(peers.ranks[members[0]]);
    if (node == node_of[peers.me]) {
      leaders.me = static_cast<int>(leaders.ranks.size()) - 1;
      for (int m : members) local.ranks.push_back(peers.ranks[m]);
      local.me =
          static_cast<int>(std::find(members.begin(), members.end(), peers.me) - members.begin());
    }
  }
  const bool leader = local.me == 0;

  AllReduceArgs inner = a;
  tree_reduce(local, inner, 0);  // tags a.tag
  if (leader) {
    inner.tag = a.tag + 2;  // ring: +2, +3; halving-doubling: +2 .. +5
    if (a.count * a.elem() > a.options->auto_small_message_bytes) {
      ring_all_reduce(leaders, inner);
    } else {
      halving_doubling_all_reduce(leaders, inner);
    }
  }
  tree_broadcast(local, a.buf, a.count * a.elem(), 0, a.tag + 6, a.deadline);
}

}  // namespace algo
}  // namespace diststrat
