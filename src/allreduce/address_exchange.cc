#include "allreduce/address_exchange.h"

#include <condition_variable>
#include <map>
#include <mutex>

#include "core/user_text.h"
#include "diststrat/error.h"

namespace diststrat {
namespace {

class InMemoryAddressExchange : public AddressExchange {
 public:
  void publish(const std::string& key, const std::string& value, Clock::time_point) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = values_.find(key);
      DISTSTRAT_CHECK(it == values_.end() || it->second == value, kInvalidArgument,
                      "address exchange: '", echo(key),
                      "' is already published with another value (two ranks with one number?)");
      values_[key] = value;
    }
    cv_.notify_all();
  }

  std::string wait_for(const std::string& key, Clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return values_.count(key) > 0; });
    auto it = values_.find(key);
    DISTSTRAT_CHECK(it != values_.end(), kDeadlineExceeded, "address exchange: '", echo(key),
                    "' was not published before the deadline");
    return it->second;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

}  // namespace

std::shared_ptr<AddressExchange> make_in_memory_address_exchange() {
  return std::make_shared<InMemoryAddressExchange>();
}

std::vector<std::optional<std::string>> exchange_addresses(AddressExchange& exchange,
                                                           const std::string& prefix, int rank,
                                                           int size, const std::string& value,
                                                           Clock::time_point deadline,
                                                           const std::string& who,
                                                           std::vector<int>* missing) {
  const std::string my_key = prefix + std::to_string(rank);
  try {
    exchange.publish(my_key, value, deadline);
  } catch (const Error& e) {
    throw_error(e.code(), who + ": publishing its addresses under '" + echo(my_key) +
                              "' failed: " + e.message());
  }
  std::vector<std::optional<std::string>> values(size);
  values[rank] = value;
  missing->clear();
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const std::string key = prefix + std::to_string(p);
    try {
      values[p] = exchange.wait_for(key, deadline);
    } catch (const DeadlineExceededError&) {
      missing->push_back(p);
    } catch (const Error& e) {
      throw_error(e.code(), who + ": reading rank " + std::to_string(p) + "'s addresses ('" +
                                echo(key) + "') failed: " + e.message());
    }
  }
  return values;
}

void throw_if_unpublished(const std::vector<int>& missing, const std::string& prefix,
                          const std::string& who) {
  DISTSTRAT_CHECK(missing.empty(), kDeadlineExceeded, who, ": ", ranks_phrase(missing),
                  " never published ", missing.size() == 1 ? "its" : "their", " addresses (keys '",
                  echo(prefix), "<rank>') before the deadline");
}

}  // namespace diststrat
