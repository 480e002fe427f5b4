// Fuzz target: the IDX reader. Any input must either parse or throw a
// diststrat::Error; anything else (a crash, a sanitizer report, another
// exception type) is a finding.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "diststrat/error.h"
#include "diststrat/io.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    diststrat::IdxArray a = diststrat::parse_idx(data, size, "fuzz input");
    size_t total = 1;
    for (int64_t d : a.dims) total *= static_cast<size_t>(d);
    if (total != a.data.size()) __builtin_trap();  // parsed but inconsistent
  } catch (const diststrat::Error&) {
  }
  // gzip-wrapped inputs go through the file reader (zlib path).
  if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) {
    char path[] = "/tmp/fuzz_idx_XXXXXX";
    const int fd = mkstemp(path);
    if (fd >= 0) {
      if (write(fd, data, size) == static_cast<ssize_t>(size)) {
        try {
          diststrat::read_idx(path);
        } catch (const diststrat::Error&) {
        }
      }
      close(fd);
      unlink(path);
    }
  }
  return 0;
}
