// Prelude "process_group": `params` (one 4x3 float32 tensor), their `names`,
// and a gradient `grad` of the same shape, for fragments run under mpirun.
#include <string>
#include <vector>

#include <diststrat/diststrat.h>
namespace ds = diststrat;
// @body
std::vector<ds::Tensor> params = {ds::Tensor({4, 3}, ds::DType::kFloat32)};
std::vector<std::string> names = {"fc/kernel"};
ds::Tensor grad({4, 3}, ds::DType::kFloat32);
