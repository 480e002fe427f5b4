// Prelude "base" (a fragment without a prelude name): the umbrella header and
// the docs' alias, nothing else. Fragments that declare what they use.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
// @body
