// diststrat-trace: merges the flight records every rank of a job dumped
// into one directory (on a deadline, an abort or a signal) and says who
// hangs the job.
//
//   diststrat-trace analyze DIR          the verdict (one line), then the
//                                        chain behind it and a table per group
//   diststrat-trace export DIR -o FILE   the merged record as a Chrome trace
//                                        (Perfetto), shaped like the library's
//                                        timeline so that both load together
//
// Every *.json file in DIR is read; a file that is not a usable record is
// skipped with one line on stderr that names it and says why.
// Exit status: 0 (a verdict, including "no divergence"; the trace written),
// 1 (the trace file could not be written), 2 (usage, or nothing usable).
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "chrome_trace.h"
#include "core/timeline.h"
#include "flight_record.h"
#include "trace_analysis.h"

namespace tr = diststrat::trace;

namespace {

constexpr const char* kUsage =
    "usage: diststrat-trace analyze DIR\n"
    "       diststrat-trace export DIR -o FILE\n"
    "DIR holds one flight record (*.json) per process of the job.\n";

int usage(const char* why) {
  if (why != nullptr) std::fprintf(stderr, "diststrat-trace: %s\n", why);
  std::fputs(kUsage, stderr);
  return 2;
}

// Loads DIR; on nothing usable prints why and returns false.
bool load(const std::string& dir, tr::LoadResult* r) {
  *r = tr::load_dir(dir);
  if (!r->error.empty()) {
    for (const std::string& m : r->messages) std::fprintf(stderr, "%s\n", m.c_str());
    std::fprintf(stderr, "diststrat-trace: %s\n", r->error.c_str());
    return false;
  }
  return true;
}

int analyze(const std::string& dir) {
  tr::LoadResult r;
  if (!load(dir, &r)) return 2;
  const tr::Verdict v = tr::analyze(r.dumps, r.files_skipped);
  std::printf("%s\n", v.line.c_str());
  std::fflush(stdout);
  for (const std::string& m : r.messages) std::fprintf(stderr, "%s\n", m.c_str());
  std::fflush(stderr);
  for (const std::string& d : v.details) std::printf("%s\n", d.c_str());
  std::printf("\n%s", tr::group_table(r.dumps).c_str());
  return 0;
}

int export_trace(const std::string& dir, const std::string& out) {
  tr::LoadResult r;
  if (!load(dir, &r)) return 2;
  for (const std::string& m : r.messages) std::fprintf(stderr, "%s\n", m.c_str());
  const std::vector<std::string> events = tr::chrome_trace_events(r.dumps);
  try {
    diststrat::Timeline::write_file(out, events);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diststrat-trace: %s\n", e.what());
    return 1;
  }
  std::printf("wrote %zu events from %zu flight records to %s\n", events.size(), r.dumps.size(),
              tr::echo_text(out, 200).c_str());
  return 0;
}

int run(int argc, char** argv) {
  if (argc < 2) return usage(nullptr);
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::string dir;
  std::string out;
  bool have_dir = false;
  bool have_out = false;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "-o") == 0 && cmd == "export") {
      if (i + 1 >= argc) return usage("-o needs a file name");
      if (have_out) return usage("-o given twice");
      out = argv[++i];
      have_out = true;
    } else if (!have_dir) {
      dir = argv[i];
      have_dir = true;
    } else {
      return usage(("unexpected argument '" + tr::echo_text(argv[i], 80) + "'").c_str());
    }
  }
  if (cmd == "analyze") {
    if (!have_dir) return usage("analyze needs a directory");
    return analyze(dir);
  }
  if (cmd == "export") {
    if (!have_dir || !have_out) return usage("export needs a directory and -o FILE");
    return export_trace(dir, out);
  }
  return usage(("unknown command '" + tr::echo_text(cmd, 40) + "'").c_str());
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {  // the last resort: the reader bounds what it holds
    std::fprintf(stderr, "diststrat-trace: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diststrat-trace: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "diststrat-trace: unknown error\n");
  }
  return 2;
}
