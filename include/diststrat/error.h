// Errors. Every failure the library reports is a diststrat::Error carrying a
// canonical code (in the spirit of absl::StatusCode) that tells the caller what
// to do next, and a message that names the rank, the operation and the tensor.
//
// Rules: errors are plain values (copyable, thread-safe); nothing here blocks.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace diststrat {

enum class ErrorCode {
  kInvalidArgument,     // fix the call: bad shape, dtype, value, config
  kFailedPrecondition,  // fix state first: used before init, after finalize, ...
  kDeadlineExceeded,    // a peer never came within the deadline
  kUnavailable,         // transient: retry the call
  kAborted,             // another replica/rank failed: retry at a higher level
  kNotFound,            // a file, variable or device does not exist
  kDataLoss,            // a file is truncated or corrupted
  kUnimplemented,       // not supported in this build / configuration
  kResourceExhausted,   // out of memory, memory limit reached, lease held
  kPermissionDenied,    // the OS refused access (EACCES/EPERM), or a file is owned by another user
  kInternal,            // a bug, or a failing backend call (CUDA, NCCL, MPI)
};

const char* error_code_name(ErrorCode code);

// Base of every exception the library throws.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }
  // The message without the "[kCode] " prefix that what() carries.
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCode code_;
  std::string message_;
};

// One subclass per code so that callers can catch the one they handle.
#define DISTSTRAT_DEFINE_ERROR(Name, Code)                             \
  class Name : public Error {                                          \
   public:                                                             \
    explicit Name(const std::string& m) : Error(ErrorCode::Code, m) {} \
  };
DISTSTRAT_DEFINE_ERROR(InvalidArgumentError, kInvalidArgument)
DISTSTRAT_DEFINE_ERROR(FailedPreconditionError, kFailedPrecondition)
DISTSTRAT_DEFINE_ERROR(DeadlineExceededError, kDeadlineExceeded)
DISTSTRAT_DEFINE_ERROR(UnavailableError, kUnavailable)
DISTSTRAT_DEFINE_ERROR(AbortedError, kAborted)
DISTSTRAT_DEFINE_ERROR(NotFoundError, kNotFound)
DISTSTRAT_DEFINE_ERROR(DataLossError, kDataLoss)
DISTSTRAT_DEFINE_ERROR(UnimplementedError, kUnimplemented)
DISTSTRAT_DEFINE_ERROR(ResourceExhaustedError, kResourceExhausted)
DISTSTRAT_DEFINE_ERROR(PermissionDeniedError, kPermissionDenied)
DISTSTRAT_DEFINE_ERROR(InternalError, kInternal)
#undef DISTSTRAT_DEFINE_ERROR

// Throws the subclass of Error that matches `code`.
[[noreturn]] void throw_error(ErrorCode code, const std::string& message);

namespace detail {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace diststrat

// Precondition checks that record the expression and both values:
//   DISTSTRAT_CHECK_EQ(a.size(), b.size(), "all_reduce 'w'") throws
//   InvalidArgumentError("all_reduce 'w': a.size() == b.size() failed: 3 vs 4").
#define DISTSTRAT_CHECK_OP_(code, op, a, b, ...)                                                   \
  do {                                                                                             \
    const auto& ds_a_ = (a);                                                                       \
    const auto& ds_b_ = (b);                                                                       \
    if (!(ds_a_ op ds_b_)) {                                                                       \
      ::diststrat::throw_error(                                                                    \
          ::diststrat::ErrorCode::code,                                                            \
          ::diststrat::detail::str_cat(__VA_ARGS__, ": ", #a, " " #op " ", #b, " failed: ", ds_a_, \
                                       " vs ", ds_b_));                                            \
    }                                                                                              \
  } while (0)
#define DISTSTRAT_CHECK_EQ(a, b, ...) DISTSTRAT_CHECK_OP_(kInvalidArgument, ==, a, b, __VA_ARGS__)
#define DISTSTRAT_CHECK_NE(a, b, ...) DISTSTRAT_CHECK_OP_(kInvalidArgument, !=, a, b, __VA_ARGS__)
#define DISTSTRAT_CHECK_LT(a, b, ...) DISTSTRAT_CHECK_OP_(kInvalidArgument, <, a, b, __VA_ARGS__)
#define DISTSTRAT_CHECK_LE(a, b, ...) DISTSTRAT_CHECK_OP_(kInvalidArgument, <=, a, b, __VA_ARGS__)
#define DISTSTRAT_CHECK_GE(a, b, ...) DISTSTRAT_CHECK_OP_(kInvalidArgument, >=, a, b, __VA_ARGS__)
#define DISTSTRAT_CHECK_GT(a, b, ...) DISTSTRAT_CHECK_OP_(kInvalidArgument, >, a, b, __VA_ARGS__)
// Boolean form: DISTSTRAT_CHECK(cond, ErrorCode, message parts...).
#define DISTSTRAT_CHECK(cond, code, ...)                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ::diststrat::throw_error(::diststrat::ErrorCode::code,               \
                               ::diststrat::detail::str_cat(__VA_ARGS__)); \
    }                                                                      \
  } while (0)
