// broadcast_tensors: a list of tensors from one rank to all, packed.
//
// It works as follows:
//   1. Every rank describes its call: root, bytes_per_pack, and for each
//      tensor its name, dtype and shape (or the error its arguments have,
//      found locally: nothing is thrown before the ranks have compared
//      notes, so a rank with bad arguments cannot leave the others waiting).
//   2. One all_gather of {status, 64-bit hash of the description, its
//      length}. When every rank is fine and every hash is equal, go to 4.
//   3. Otherwise one more all_gather of the descriptions themselves (padded
//      to the longest), so that every rank sees every rank's list and throws
//      the same InvalidArgumentError naming the first rank and tensor that
//      differ. Both all_gathers are made by every rank, so the communicator
//      stays in step and usable.
//   4. The tensors are cut, in order, into packs of up to bytes_per_pack
//      bytes (the plan is the same on every rank: the lists are equal). A
//      pack is copied into a staging buffer on the root, broadcast as one
//      message, and copied out elsewhere; a tensor of bytes_per_pack bytes or
//      more is broadcast on its own, in its own memory.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "core/fnv1a.h"
#include "core/user_text.h"
#include "diststrat/error.h"
#include "diststrat/process_group.h"

namespace diststrat {

namespace {

// What one rank called broadcast_tensors with, as the ranks exchange it.
struct CallDescription {
  std::string error;  // non-empty: this rank's arguments are invalid
  int64_t root = 0;
  uint64_t bytes_per_pack = 0;
  std::vector<std::string> entries;  // "#i 'name' float32[4, 5]", for messages
};

class Writer {
 public:
  template <typename T>
  void value(T v) {
    const size_t at = out_.size();
    out_.resize(at + sizeof v);
    std::memcpy(&out_[at], &v, sizeof v);
  }
  void text(const std::string& s) {
    value<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads what a peer sent; false when it does not parse (never reads past
// `size`).
class Reader {
 public:
  Reader(const char* p, size_t size) : p_(p), left_(size) {}
  template <typename T>
  bool value(T* v) {
    if (left_ < sizeof *v) return false;
    std::memcpy(v, p_, sizeof *v);
    p_ += sizeof *v;
    left_ -= sizeof *v;
    return true;
  }
  bool text(std::string* s) {
    uint32_t n = 0;
    if (!value(&n) || left_ < n) return false;
    s->assign(p_, n);
    p_ += n;
    left_ -= n;
    return true;
  }

 private:
  const char* p_;
  size_t left_;
};

std::string encode(const CallDescription& d) {
  Writer w;
  w.value<uint8_t>(d.error.empty() ? 0 : 1);
  if (!d.error.empty()) {
    w.text(d.error);
    return w.take();
  }
  w.value(d.root);
  w.value(d.bytes_per_pack);
  w.value<uint32_t>(static_cast<uint32_t>(d.entries.size()));
  for (const std::string& e : d.entries) w.text(e);
  return w.take();
}

bool decode(const char* p, size_t size, CallDescription* d) {
  Reader r(p, size);
  uint8_t has_error = 0;
  if (!r.value(&has_error)) return false;
  if (has_error) return r.text(&d->error) && !d->error.empty();
  uint32_t n = 0;
  if (!r.value(&d->root) || !r.value(&d->bytes_per_pack) || !r.value(&n)) return false;
  // Each entry takes at least its 4-byte length: a count that cannot fit is junk.
  if (n > size / 4) return false;
  d->entries.resize(n);
  for (std::string& e : d->entries) {
    if (!r.text(&e)) return false;
  }
  return true;
}

std::string label(const std::vector<std::string>& names, size_t i) {
  std::string s = "#" + std::to_string(i);
  if (i < names.size()) s += " '" + echo(names[i]) + "'";
  return s;
}

// This rank's description, its hash, and the local argument checks.
CallDescription describe(const Communicator& comm, const std::vector<Tensor>& tensors, int root,
                         const std::vector<std::string>& names, uint64_t* hash) {
  CallDescription d;
  d.root = root;
  d.bytes_per_pack = comm.options().bytes_per_pack;
  std::ostringstream err;
  if (root < 0 || root >= comm.size()) {
    err << "root " << root << " is not a rank of this group of " << comm.size();
  } else if (!names.empty() && names.size() != tensors.size()) {
    err << "names has " << names.size() << " entries for " << tensors.size()
        << " tensors (give one per tensor, or none)";
  }
  Fnv1a h;
  h.value(d.root);
  h.value(d.bytes_per_pack);
  h.value<uint64_t>(tensors.size());
  const bool args_ok = err.tellp() == 0;
  for (size_t i = 0; args_ok && i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined()) {
      err << "tensor " << label(names, i) << " is undefined (a default-constructed Tensor)";
      break;
    }
    if (!t.device().is_cpu()) {
      err << "tensor " << label(names, i) << " is " << t.debug_string()
          << "; broadcast_tensors moves host memory (copy it to the host first)";
      break;
    }
    h.text(i < names.size() ? names[i] : std::string());
    h.value(static_cast<int32_t>(t.dtype()));
    h.value<uint64_t>(t.shape().rank());
    for (int64_t dim : t.shape().dims()) h.value(dim);
    d.entries.push_back(label(names, i) + " " + dtype_name(t.dtype()) + t.shape().to_string());
  }
  d.error = err.str();
  if (!d.error.empty()) d.entries.clear();
  *hash = h.get();
  return d;
}

// The message every rank throws for descriptions that do not all agree.
std::string explain(const std::vector<CallDescription>& all) {
  const int n = static_cast<int>(all.size());
  std::vector<int> failed;
  for (int r = 0; r < n; ++r) {
    if (!all[r].error.empty()) failed.push_back(r);
  }
  std::ostringstream os;
  if (!failed.empty()) {
    const int f = failed[0];
    os << "rank " << f << " was called with invalid arguments: " << all[f].error;
    if (failed.size() > 1) os << " (ranks with invalid arguments: " << join_ranks(failed) << ")";
    return os.str();
  }
  for (int r = 1; r < n; ++r) {
    if (all[r].root != all[0].root) {
      os << "the ranks disagree on the root: rank 0 passed root " << all[0].root << ", rank " << r
         << " root " << all[r].root;
      return os.str();
    }
  }
  for (int r = 1; r < n; ++r) {
    if (all[r].bytes_per_pack != all[0].bytes_per_pack) {
      os << "the ranks' communicators pack differently: bytes_per_pack " << all[0].bytes_per_pack
         << " on rank 0, " << all[r].bytes_per_pack << " on rank " << r;
      return os.str();
    }
  }
  const int root = static_cast<int>(all[0].root);
  const std::vector<std::string>& want = all[root].entries;
  std::vector<int> differ;
  for (int r = 0; r < n; ++r) {
    if (all[r].entries != want) differ.push_back(r);
  }
  os << "the tensor lists differ from root " << root << "'s (" << want.size() << " tensors): ";
  if (differ.empty()) {
    // Equal as shown, different as hashed: names that differ past what an
    // error message echoes.
    os << "some rank's tensor names differ from the root's beyond the first " << kMaxEchoedChars
       << " characters";
    return os.str();
  }
  const int r = differ[0];
  const std::vector<std::string>& got = all[r].entries;
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  if (i < got.size() && i < want.size()) {
    os << "rank " << r << " has " << got[i] << ", root " << root << " has " << want[i];
  } else if (i < got.size()) {
    os << "rank " << r << " has " << got.size() << " tensors, root " << root << " has "
       << want.size() << ": rank " << r << "'s tensor " << got[i] << " is extra";
  } else {
    os << "rank " << r << " has " << got.size() << " tensors, root " << root << " has "
       << want.size() << ": rank " << r << " has no tensor " << want[i];
  }
  if (differ.size() > 1) os << " (ranks that differ: " << join_ranks(differ) << ")";
  return os.str();
}

// Steps 1-3: returns when every rank's call matches; else every rank throws.
void agree_on_call(Communicator& comm, const std::vector<Tensor>& tensors, int root,
                   const std::vector<std::string>& names) {
  const int n = comm.size(), me = comm.rank();
  uint64_t hash = 0;
  const CallDescription mine = describe(comm, tensors, root, names, &hash);
  const std::string prefix = "rank " + std::to_string(me) + ": broadcast_tensors: ";
  if (n == 1) {
    if (!mine.error.empty()) throw InvalidArgumentError(prefix + mine.error);
    return;
  }
  const std::string payload = encode(mine);
  int64_t header[3] = {mine.error.empty() ? 0 : 1, static_cast<int64_t>(hash),
                       static_cast<int64_t>(payload.size())};
  std::vector<int64_t> headers(3 * static_cast<size_t>(n));
  comm.all_gather(header, headers.data(), 3, DType::kInt64, "broadcast_tensors/signatures");
  bool agree = true;
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t* h = &headers[3 * static_cast<size_t>(r)];
    if (h[0] != 0 || h[1] != headers[1]) agree = false;
    longest = std::max(longest, h[2]);
  }
  if (agree) return;
  // Every rank got the same headers, so every rank is here.
  const size_t words = (static_cast<size_t>(longest) + 7) / 8;
  std::vector<int64_t> padded(words, 0), gathered(words * n);
  if (!payload.empty()) std::memcpy(padded.data(), payload.data(), payload.size());
  comm.all_gather(padded.data(), gathered.data(), words, DType::kInt64,
                  "broadcast_tensors/descriptions");
  std::vector<CallDescription> all(n);
  for (int r = 0; r < n; ++r) {
    const int64_t len = headers[3 * static_cast<size_t>(r) + 2];
    const char* p = reinterpret_cast<const char*>(gathered.data() + r * words);
    if (len < 0 || len > longest || !decode(p, static_cast<size_t>(len), &all[r])) {
      throw InvalidArgumentError(prefix + "rank " + std::to_string(r) +
                                 " sent a call description that does not parse (is it running "
                                 "the same diststrat?)");
    }
  }
  throw InvalidArgumentError(prefix + explain(all));
}

// Step 4, one pack: tensors [begin, end) of one message.
void broadcast_pack(Communicator& comm, std::vector<Tensor>& tensors, size_t begin, size_t end,
                    int root, const std::vector<std::string>& names) {
  const bool is_root = comm.rank() == root;
  const std::string what = end - begin == 1 ? "broadcast_tensors " + label(names, begin)
                                            : "broadcast_tensors pack " + label(names, begin) +
                                                  ".." + label(names, end - 1) + " (" +
                                                  std::to_string(end - begin) + " tensors)";
  if (end - begin == 1) {
    Tensor& t = tensors[begin];
    comm.broadcast(t.data(), static_cast<size_t>(t.num_elements()), t.dtype(), root, what);
    return;
  }
  size_t bytes = 0;
  for (size_t i = begin; i < end; ++i) bytes += tensors[i].nbytes();
  std::vector<int64_t> staging((bytes + 7) / 8);
  char* p = reinterpret_cast<char*>(staging.data());
  if (is_root) {
    for (size_t i = begin; i < end; ++i) {
      const size_t b = tensors[i].nbytes();
      if (b) std::memcpy(p, tensors[i].data(), b);
      p += b;
    }
  }
  comm.broadcast(staging.data(), staging.size(), DType::kInt64, root, what);
  if (!is_root) {
    for (size_t i = begin; i < end; ++i) {
      const size_t b = tensors[i].nbytes();
      if (b) std::memcpy(tensors[i].data(), p, b);
      p += b;
    }
  }
}

}  // namespace

void broadcast_tensors(Communicator& comm, std::vector<Tensor>& tensors, int root,
                       const std::vector<std::string>& names) {
  agree_on_call(comm, tensors, root, names);
  if (comm.size() == 1) return;
  const size_t limit = comm.options().bytes_per_pack;
  size_t begin = 0, bytes = 0;
  auto flush = [&](size_t end) {
    if (bytes > 0) broadcast_pack(comm, tensors, begin, end, root, names);
    begin = end;
    bytes = 0;
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t b = tensors[i].nbytes();
    if (limit != 0 && bytes > 0 && bytes + b > limit) flush(i);
    if (bytes == 0) begin = i;
    bytes += b;
    if (limit != 0 && bytes >= limit) flush(i + 1);
  }
  flush(tensors.size());
}

}  // namespace diststrat
