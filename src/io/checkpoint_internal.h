// Internals of checkpoints shared by src/io and the strategies that take part
// in saving (the parameter server): the chief-runs-then-everyone-agrees
// protocol, broadcasts of small values from the chief, safetensors files with
// our reserved metadata keys, and the sharded (parameter-server) format:
//
//   <stem>.safetensors                         the index: no tensors; user metadata and
//                                              "diststrat.ps_index" (JSON, below)
//   <stem>.ps-<i>-of-<n>.<save id>.safetensors PS rank i's shards: "<var>/shard-<k>" and
//                                              "<var>/shard-<k>/<slot>"; "diststrat.ps_shard"
//                                              (JSON: each shard's rows and step counter)
//
// The index names its shard files, the save id (a random 64-bit number every
// file of one save carries), and every variable's dtype, full shape and
// shards (PS index, row offset, rows). See docs/parameter_server.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/checkpoint.h"

namespace diststrat {
namespace ckpt {

// Whether this process writes files (the chief, or the only process).
bool is_writer(const Strategy& s);
bool is_multi_process(const Strategy& s);
// Broadcasts from worker 0; every process calls them in the same order.
int64_t broadcast_int(Strategy& s, int64_t v, const std::string& name);
std::string broadcast_string(Strategy& s, const std::string& v, const std::string& name);
// Runs fn on the chief only and re-raises its error (same code) everywhere.
void on_chief_then_agree(Strategy& s, const std::string& what, const std::function<void()>& fn);
std::string encode_metadata(const CheckpointMetadata& md);
CheckpointMetadata decode_metadata(const std::string& s);

// A safetensors file's header alone (cheap for any file size): its
// __metadata__, and whether its diststrat header checksum is present and
// matches. Opened safely (core/file_util.h). Throws NotFoundError,
// DataLossError (bad length, JSON or checksum) naming the file.
struct SafetensorsHeader {
  CheckpointMetadata metadata;
  bool verified = false;
};
SafetensorsHeader read_safetensors_header(const std::string& path);

// The reserved metadata key CheckpointManager::save writes into every
// checkpoint (the index, for a sharded one): the step of its file name. A
// "ckpt-<N>.safetensors" whose verified header carries N here is one the
// manager wrote; nothing else is ever pruned or counted.
constexpr const char* kManagerStepKey = "diststrat.manager_step";

// Metadata keys under this prefix are the library's own: users' metadata may
// not use it (save refuses), restore hands them back without them.
constexpr const char* kReservedPrefix = "diststrat.";

// Every verified file's header CRC (8 hex digits) in its metadata.
constexpr const char* kHeaderCrcMetadataKey = "diststrat.header_crc32";

// Reserved metadata: the save was made with allow_non_finite (the value is
// kNonFiniteAllowed); without it, save_safetensors_reserved refuses NaN/Inf.
constexpr const char* kNonFiniteKey = "diststrat.non_finite";
constexpr const char* kNonFiniteAllowed = "allowed";

// Strict decimal integer ("-12", no spaces, no '+', no exponent) within
// [lo, hi]; false otherwise (never throws).
bool parse_int(const std::string& text, int64_t lo, int64_t hi, int64_t* out);

// The bytes save_safetensors writes (`path` names them in errors), for a
// transfer in memory; `allow_reserved`: metadata keys may use "diststrat.".
std::vector<char> encode_safetensors(const std::string& path,
                                     const std::vector<std::pair<std::string, Tensor>>& tensors,
                                     const CheckpointMetadata& metadata, bool allow_reserved,
                                     bool allow_non_finite);

// save_safetensors that also accepts metadata keys with the reserved prefix.
void save_safetensors_reserved(const std::string& path,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               const CheckpointMetadata& metadata);

// Whether this process received a preemption signal (a PreemptionHandler is
// installed). Async-signal-safe flag, read by the PS service too.
bool preemption_signalled();

// ---- the sharded format ------------------------------------------------------

constexpr const char* kIndexKey = "diststrat.ps_index";
constexpr const char* kShardKey = "diststrat.ps_shard";

// The shard file of PS `ps` of `num_ps` for index `index_path`, save `save_id`.
std::string shard_file_path(const std::string& index_path, int ps, int num_ps, uint64_t save_id);

// Writes `shards` (one PS rank's, from Service::snapshot) atomically.
void write_shard_file(const std::string& path, uint64_t save_id, int ps, int num_ps,
                      const std::vector<ShardSnapshot>& shards);

struct IndexShard {
  int64_t index = 0;
  int ps = 0;
  int64_t row_offset = 0, rows = 0;
};
struct IndexVariable {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<IndexShard> shards;
};
// Writes the index atomically (after every shard file is durable).
void write_index(const std::string& path, uint64_t save_id,
                 const std::vector<std::string>& shard_files,
                 const std::vector<IndexVariable>& variables,
                 const CheckpointMetadata& user_metadata);

// A checkpoint read whole: for a sharded one the reassembled tensors in
// checkpoint names ("<var>", "<var>/<slot>") and each shard's step counter.
struct LoadedCheckpoint {
  SafetensorsFile file;
  bool sharded = false;
  // Sharded only: per variable, (row_offset, rows, step) of each saved shard.
  std::map<std::string, std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>>> steps;
};
// Reads and verifies everything (index, every shard file, their agreement);
// throws NotFoundError / DataLossError naming the file and tensor.
LoadedCheckpoint load_any(const std::string& path, const SafetensorsLoadOptions& options);

// The parts of a shard file's name "ckpt-<N>.ps-<i>-of-<n>.<save id, 16 hex>.safetensors"
// (shard_file_path of "ckpt-<N>.safetensors"); nullopt for any other name.
struct ShardFileName {
  std::string index_name;  // "ckpt-<N>.safetensors"
  int ps = 0, num_ps = 0;
  uint64_t save_id = 0;
};
std::optional<ShardFileName> parse_shard_file_name(const std::string& name);
// Whether `path` is a shard file a save of ours wrote: its name parses and
// its verified header's shard metadata carries the same save id, PS and PS
// count. Header only; never throws.
bool is_own_shard_file(const std::string& path);

// The shard files an index names (empty for a single-file checkpoint or an
// unreadable index). Used to prune.
std::vector<std::string> shard_files_of(const std::string& index_path);

}  // namespace ckpt
}  // namespace diststrat
