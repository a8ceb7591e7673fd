// The JSON writer of `run --json`, `explain --json`, `info --json` and `bench --json FILE`: one
// object with its keys in insertion order, arrays of values already in JSON form, and JSON
// strings.
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

  // `s` as a JSON string: quotes and backslashes escaped, control characters as \u00XX, valid
  // UTF-8 as it is, and each byte that does not begin a valid UTF-8 sequence as \ufffd (the
  // replacement character): the output is always valid UTF-8.
  static std::string quoted(std::string_view s) {
    std::string q = "\"";
    for (std::size_t at = 0; at < s.size();) {
      const char ch = s[at];
      const std::size_t n = utf8_length(s, at);
      if (n == 0) {
        q += "\\ufffd";
        ++at;
      } else if (ch == '"' || ch == '\\') {
        q += '\\';
        q += ch;
        ++at;
      } else if (static_cast<unsigned char>(ch) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", ch);
        q += buf;
        ++at;
      } else {
        q.append(s, at, n);
        at += n;
      }
    }
    return q + "\"";
  }

 private:
  // The length (1 to 4) of the well-formed UTF-8 sequence at s[at] (Unicode table 3-7: no
  // overlong forms, surrogates or code points past U+10FFFF), 0 where there is none.
  static std::size_t utf8_length(std::string_view s, std::size_t at) {
    auto byte = [&](std::size_t k) -> unsigned {
      return at + k < s.size() ? static_cast<unsigned char>(s[at + k]) : 0u;
    };
    const unsigned lead = byte(0);
    if (lead < 0x80) return 1;
    std::size_t n = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
    if (lead >= 0xC2 && lead <= 0xDF) {
      n = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      n = 3;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      n = 4;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    } else {
      return 0;
    }
    for (std::size_t k = 1; k < n; ++k, lo = 0x80, hi = 0xBF) {
      if (byte(k) < lo || byte(k) > hi) return 0;
    }
    return n;
  }

  void raw(const char* key, const std::string& value) {
    if (!body_.empty()) body_ += ", ";
    body_ += '"';
    body_ += key;
    body_ += "\": ";
    body_ += value;
  }
  std::string body_;
};

// Prints `j` on standard output as the command's one JSON object (run, explain and info
// --json, bench --json -). Defined in main.cpp, which prints an object with an `error` field
// instead when such a command fails before printing its own.
void print_json_object(const JsonObject& j);

// A JSON array of values already in JSON form.
inline std::string json_array(const std::vector<std::string>& items) {
  std::string s = "[";
  for (std::size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + items[i];
  return s + "]";
}

}  // namespace attncore_tools
