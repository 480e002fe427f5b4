#include "allreduce/call_text.h"

#include <sstream>

#include "core/user_text.h"

namespace diststrat {

std::string describe_call(const char* kind, size_t count, DType dtype, const ReduceOp* op,
                          const std::string& name) {
  std::ostringstream os;
  os << kind << " of " << count << " " << dtype_name(dtype);
  if (op) os << " " << reduce_op_name(*op);
  if (!name.empty()) os << " '" << echo(name) << "'";
  return os.str();
}

std::string CallText::str() const {
  static const std::string kNoName;
  const std::string& n = name ? *name : kNoName;
  std::string s = std::string(kind) == "barrier"
                      ? std::string(kind) + (n.empty() ? "" : " '" + echo(n) + "'")
                      : describe_call(kind, count, dtype, op, n);
  if (root) s += " from root " + std::to_string(*root);
  if (via) s += std::string(" (") + via + ")";
  return s;
}

}  // namespace diststrat
