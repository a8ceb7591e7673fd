// The JSON writer of `run --json`, `explain --json` and `bench --json FILE`: one object with its
// keys in insertion order, arrays of values already in JSON form, and JSON strings.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace attncore_tools {

class JsonObject {
 public:
  void add(const char* key, std::string_view s) { raw(key, quoted(s)); }
  void add(const char* key, const char* s) { add(key, std::string_view(s)); }
  void add(const char* key, bool b) { raw(key, b ? "true" : "false"); }
  void add(const char* key, std::int64_t i) { raw(key, std::to_string(i)); }
  void add(const char* key, std::uint64_t i) { raw(key, std::to_string(i)); }
  void add(const char* key, int i) { raw(key, std::to_string(i)); }
  // Non-finite numbers have no JSON form: written as the strings "nan", "inf", "-inf".
  void add(const char* key, double d) {
    if (std::isnan(d)) return add(key, "nan");
    if (std::isinf(d)) return add(key, d > 0 ? "inf" : "-inf");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", d);
    raw(key, buf);
  }
  // An absent value is null.
  void add(const char* key, std::optional<double> d) {
    if (d) return add(key, *d);
    raw(key, "null");
  }
  void add_null(const char* key) { raw(key, "null"); }
  // `json`: a value already in JSON form (an object, an array).
  void add_json(const char* key, const std::string& json) { raw(key, json); }
  std::string str() const { return "{" + body_ + "}"; }

  // `s` as a JSON string: quotes and backslashes escaped, control characters as \u00XX.
  static std::string quoted(std::string_view s) {
    std::string q = "\"";
    for (char ch : s) {
      if (ch == '"' || ch == '\\') {
        q += '\\';
        q += ch;
      } else if (static_cast<unsigned char>(ch) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", ch);
        q += buf;
      } else {
        q += ch;
      }
    }
    return q + "\"";
  }

 private:
  void raw(const char* key, const std::string& value) {
    if (!body_.empty()) body_ += ", ";
    body_ += '"';
    body_ += key;
    body_ += "\": ";
    body_ += value;
  }
  std::string body_;
};

// A JSON array of values already in JSON form.
inline std::string json_array(const std::vector<std::string>& items) {
  std::string s = "[";
  for (std::size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + items[i];
  return s + "]";
}

}  // namespace attncore_tools
