// Progress lines on standard error, shown only when standard error is a terminal: redirected
// (a log file, a pipe, ctest) it gets no progress and no carriage returns.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace attncore_tools {

class Progress {
 public:
  Progress() : on_(isatty(fileno(stderr)) != 0) {}
  ~Progress() { clear(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Replaces the line shown with `text`.
  void show(const std::string& text) {
    if (!on_) return;
    std::fprintf(stderr, "\r%-*s", static_cast<int>(width_), text.c_str());
    width_ = std::max(width_, text.size());
    std::fflush(stderr);
  }

  // The same through a printf format.
  template <class... Args>
  void showf(const char* format, Args... args) {
    char text[256];
    std::snprintf(text, sizeof text, format, args...);
    show(text);
  }

  // Erases the line shown.
  void clear() {
    if (!on_ || width_ == 0) return;
    std::fprintf(stderr, "\r%*s\r", static_cast<int>(width_), "");
    std::fflush(stderr);
    width_ = 0;
  }

 private:
  bool on_;
  std::size_t width_ = 0;
};

}  // namespace attncore_tools
