#include "diststrat/error.h"

namespace diststrat {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "kInvalidArgument";
    case ErrorCode::kFailedPrecondition:
      return "kFailedPrecondition";
    case ErrorCode::kDeadlineExceeded:
      return "kDeadlineExceeded";
    case ErrorCode::kUnavailable:
      return "kUnavailable";
    case ErrorCode::kAborted:
      return "kAborted";
    case ErrorCode::kNotFound:
      return "kNotFound";
    case ErrorCode::kDataLoss:
      return "kDataLoss";
    case ErrorCode::kUnimplemented:
      return "kUnimplemented";
    case ErrorCode::kResourceExhausted:
      return "kResourceExhausted";
    case ErrorCode::kPermissionDenied:
      return "kPermissionDenied";
    case ErrorCode::kInternal:
      return "kInternal";
  }
  return "kUnknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string("[") + error_code_name(code) + "] " + message),
      code_(code),
      message_(message) {}

void throw_error(ErrorCode code, const std::string& message) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      throw InvalidArgumentError(message);
    case ErrorCode::kFailedPrecondition:
      throw FailedPreconditionError(message);
    case ErrorCode::kDeadlineExceeded:
      throw DeadlineExceededError(message);
    case ErrorCode::kUnavailable:
      throw UnavailableError(message);
    case ErrorCode::kAborted:
      throw AbortedError(message);
    case ErrorCode::kNotFound:
      throw NotFoundError(message);
    case ErrorCode::kDataLoss:
      throw DataLossError(message);
    case ErrorCode::kUnimplemented:
      throw UnimplementedError(message);
    case ErrorCode::kResourceExhausted:
      throw ResourceExhaustedError(message);
    case ErrorCode::kPermissionDenied:
      throw PermissionDeniedError(message);
    case ErrorCode::kInternal:
      throw InternalError(message);
  }
  throw Error(code, message);
}

}  // namespace diststrat
