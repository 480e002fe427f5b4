// Fuzz target: the safetensors checkpoint loader (parse_safetensors, the
// in-memory entry point of load_safetensors). Any input must either parse or
// throw a diststrat::Error. Both modes are exercised: checksums required (our
// own files) and optional (files from other tools), so the fuzzer reaches the
// header/offset validation without having to forge CRC-32s.
#include <cstdint>

#include "diststrat/checkpoint.h"
#include "diststrat/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (bool require : {false, true}) {
    diststrat::SafetensorsLoadOptions options;
    options.require_checksums = require;
    try {
      diststrat::SafetensorsFile f =
          diststrat::parse_safetensors(data, size, "fuzz input", options);
      size_t bytes = 0;
      for (const auto& [name, t] : f.tensors) {
        if (name.empty()) __builtin_trap();
        bytes += t.nbytes();
      }
      if (bytes > size) __builtin_trap();  // tensors cannot hold more than the input
      if (require && !f.verified) __builtin_trap();
    } catch (const diststrat::Error&) {
    }
  }
  return 0;
}
