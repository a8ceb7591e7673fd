// A line chart written as a PNG, with no library: an RGB raster, a 5x7 pixel font, and a PNG
// encoder that stores the image uncompressed (deflate "stored" blocks).
#include "plot.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace attncore_tools {
namespace {

// 5x7 glyphs, one string of 7 rows x 5 columns each ('#' = ink). Upper case prints as lower.
struct Glyph {
  char c;
  const char* rows[7];
};
constexpr Glyph kFont[] = {
    {'0', {" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "}},
    {'1', {"  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'2', {" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"}},
    {'3', {"#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "}},
    {'4', {"   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "}},
    {'5', {"#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "}},
    {'6', {"  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "}},
    {'7', {"#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "}},
    {'8', {" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "}},
    {'9', {" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "}},
    {'a', {"     ", "     ", " ### ", "    #", " ####", "#   #", " ####"}},
    {'b', {"#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#### "}},
    {'c', {"     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### "}},
    {'d', {"    #", "    #", " ## #", "#  ##", "#   #", "#   #", " ####"}},
    {'e', {"     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "}},
    {'f', {"  ## ", " #  #", " #   ", "###  ", " #   ", " #   ", " #   "}},
    {'g', {"     ", " ####", "#   #", "#   #", " ####", "    #", " ### "}},
    {'h', {"#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#   #"}},
    {'i', {"  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'j', {"   # ", "     ", "  ## ", "   # ", "   # ", "#  # ", " ##  "}},
    {'k', {"#    ", "#    ", "#  # ", "# #  ", "##   ", "# #  ", "#  # "}},
    {'l', {" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "}},
    {'m', {"     ", "     ", "## # ", "# # #", "# # #", "#   #", "#   #"}},
    {'n', {"     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"}},
    {'o', {"     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "}},
    {'p', {"     ", "     ", "#### ", "#   #", "#### ", "#    ", "#    "}},
    {'q', {"     ", "     ", " ## #", "#  ##", " ####", "    #", "    #"}},
    {'r', {"     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "}},
    {'s', {"     ", "     ", " ### ", "#    ", " ### ", "    #", "#### "}},
    {'t', {" #   ", " #   ", "###  ", " #   ", " #   ", " #  #", "  ## "}},
    {'u', {"     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #"}},
    {'v', {"     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  "}},
    {'w', {"     ", "     ", "#   #", "#   #", "# # #", "# # #", " # # "}},
    {'x', {"     ", "     ", "#   #", " # # ", "  #  ", " # # ", "#   #"}},
    {'y', {"     ", "     ", "#   #", "#   #", " ####", "    #", " ### "}},
    {'z', {"     ", "     ", "#####", "   # ", "  #  ", " #   ", "#####"}},
    {'.', {"     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "}},
    {'/', {"     ", "    #", "   # ", "  #  ", " #   ", "#    ", "     "}},
    {'-', {"     ", "     ", "     ", "#####", "     ", "     ", "     "}},
    {'=', {"     ", "     ", "#####", "     ", "#####", "     ", "     "}},
    {'%', {"##   ", "##  #", "   # ", "  #  ", " #   ", "#  ##", "   ##"}},
    {'(', {"   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "}},
    {')', {" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "}},
    {',', {"     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "}},
    {':', {"     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "}},
    {'_', {"     ", "     ", "     ", "     ", "     ", "     ", "#####"}},
};

struct Rgb {
  std::uint8_t r, g, b;
};

class Image {
 public:
  Image(int width, int height)
      : width_(width), height_(height), pixels_(3u * width * height, 255) {}

  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
    const std::size_t at = 3u * (static_cast<std::size_t>(y) * width_ + x);
    pixels_[at] = c.r;
    pixels_[at + 1] = c.g;
    pixels_[at + 2] = c.b;
  }
  void rect(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  // A line `width` pixels thick (Bresenham, stamping a square).
  void line(int x0, int y0, int x1, int y1, Rgb c, int width = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (;;) {
      rect(x0 - width / 2, y0 - width / 2, x0 + (width - 1) / 2, y0 + (width - 1) / 2, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }
  // Text with its top-left corner at (x, y), each font pixel drawn as scale x scale.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 1) {
    for (char ch : s) {
      const char lower = (ch >= 'A' && ch <= 'Z') ? static_cast<char>(ch - 'A' + 'a') : ch;
      // Letters with descenders sit two font rows lower.
      const int drop =
          (lower == 'g' || lower == 'j' || lower == 'p' || lower == 'q' || lower == 'y') ? 2 : 0;
      for (const Glyph& g : kFont) {
        if (g.c != lower) continue;
        for (int row = 0; row < 7; ++row)
          for (int col = 0; col < 5; ++col)
            if (g.rows[row][col] == '#') {
              rect(x + col * scale, y + (row + drop) * scale, x + (col + 1) * scale - 1,
                   y + (row + drop + 1) * scale - 1, c);
            }
      }
      x += 6 * scale;
    }
  }
  static int text_width(const std::string& s, int scale = 1) {
    return static_cast<int>(s.size()) * 6 * scale;
  }

  bool write_png(const std::string& path) const;

 private:
  int width_, height_;
  std::vector<std::uint8_t> pixels_;  // [height][width][3]
};

std::uint32_t crc32(const std::uint8_t* data, std::size_t n, std::uint32_t crc = 0) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void put32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(v >> s));
}

void chunk(std::vector<std::uint8_t>& out, const char* type,
           const std::vector<std::uint8_t>& data) {
  put32(out, static_cast<std::uint32_t>(data.size()));
  std::vector<std::uint8_t> body(type, type + 4);
  body.insert(body.end(), data.begin(), data.end());
  out.insert(out.end(), body.begin(), body.end());
  put32(out, crc32(body.data(), body.size()));
}

bool Image::write_png(const std::string& path) const {
  // Raw scanlines, each led by filter byte 0 (none).
  std::vector<std::uint8_t> raw;
  raw.reserve(static_cast<std::size_t>(height_) * (3u * width_ + 1));
  for (int y = 0; y < height_; ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), pixels_.begin() + 3u * y * width_,
               pixels_.begin() + 3u * (y + 1) * width_);
  }
  // zlib: header, deflate stored blocks of at most 65535 bytes, Adler-32.
  std::vector<std::uint8_t> z = {0x78, 0x01};
  for (std::size_t at = 0; at < raw.size();) {
    const std::size_t n = std::min<std::size_t>(65535, raw.size() - at);
    z.push_back(at + n == raw.size() ? 1 : 0);
    z.push_back(static_cast<std::uint8_t>(n));
    z.push_back(static_cast<std::uint8_t>(n >> 8));
    z.push_back(static_cast<std::uint8_t>(~n));
    z.push_back(static_cast<std::uint8_t>(~n >> 8));
    z.insert(z.end(), raw.begin() + static_cast<std::ptrdiff_t>(at),
             raw.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  }
  std::uint32_t a = 1, b = 0;
  for (std::uint8_t byte : raw) {
    a = (a + byte) % 65521;
    b = (b + a) % 65521;
  }
  put32(z, (b << 16) | a);

  std::vector<std::uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<std::uint8_t> header;
  put32(header, static_cast<std::uint32_t>(width_));
  put32(header, static_cast<std::uint32_t>(height_));
  header.insert(header.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, deflate, no filter, no interlace
  chunk(png, "IHDR", header);
  chunk(png, "IDAT", z);
  chunk(png, "IEND", {});
  std::ofstream file(path, std::ios::binary);
  file.write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
  file.close();  // (a full disk may show only as the buffer is written)
  return !file.fail();
}

std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, v >= 100 || v == std::floor(v) ? "%.0f" : "%.1f", v);
  return buf;
}

}  // namespace

bool write_line_chart(const LineChart& chart, const std::string& path) {
  constexpr int kWidth = 960, kHeight = 600;
  constexpr int kLeft = 90, kRight = 30, kTop = 60, kBottom = 70;
  constexpr Rgb kInk{40, 40, 40}, kGrid{225, 225, 225};
  constexpr Rgb kColors[] = {{31, 119, 180},  {255, 127, 14}, {44, 160, 44},   {214, 39, 40},
                             {148, 103, 189}, {140, 86, 75},  {227, 119, 194}, {127, 127, 127}};
  Image img(kWidth, kHeight);
  double x_min = INFINITY, x_max = -INFINITY, y_max = 0;
  for (const Series& s : chart.series) {
    for (const auto& [x, y] : s.points) {
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_max = std::max(y_max, y);
    }
  }
  if (!(x_max > 0) || !(y_max > 0)) return false;
  if (x_min == x_max) x_max = x_min * 2;
  // y axis: 0 .. a round number above the largest value, in 5 steps.
  const double raw_step = y_max / 5;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw_step)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * magnitude >= raw_step) {
      step = m * magnitude;
      break;
    }
  }
  const double y_top = step * std::ceil(y_max / step);
  const int plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto px = [&](double x) {  // log2 x axis
    return kLeft + static_cast<int>(std::lround((std::log2(x) - std::log2(x_min)) /
                                                (std::log2(x_max) - std::log2(x_min)) * plot_w));
  };
  auto py = [&](double y) {
    return kTop + plot_h - static_cast<int>(std::lround(y / y_top * plot_h));
  };

  for (double y = 0; y <= y_top + step / 2; y += step) {
    img.line(kLeft, py(y), kLeft + plot_w, py(y), kGrid);
    const std::string label = format_number(y);
    img.text(kLeft - 8 - Image::text_width(label, 2), py(y) - 7, label, kInk, 2);
  }
  std::vector<double> xs;
  for (const Series& s : chart.series)
    for (const auto& point : s.points) xs.push_back(point.first);
  std::sort(xs.begin(), xs.end());
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  for (double x : xs) {
    img.line(px(x), kTop, px(x), kTop + plot_h, kGrid);
    const std::string label = format_number(x);
    img.text(px(x) - Image::text_width(label, 2) / 2, kTop + plot_h + 10, label, kInk, 2);
  }
  img.line(kLeft, kTop, kLeft, kTop + plot_h, kInk, 2);
  img.line(kLeft, kTop + plot_h, kLeft + plot_w, kTop + plot_h, kInk, 2);
  img.text(kLeft + plot_w / 2 - Image::text_width(chart.x_label, 2) / 2, kHeight - 30,
           chart.x_label, kInk, 2);
  img.text(10, 20, chart.y_label, kInk, 2);
  img.text(kWidth - kRight - Image::text_width(chart.title, 2), 20, chart.title, kInk, 2);

  for (std::size_t n = 0; n < chart.series.size(); ++n) {
    const Series& s = chart.series[n];
    const Rgb color = kColors[n % std::size(kColors)];
    for (std::size_t i = 0; i + 1 < s.points.size(); ++i) {
      img.line(px(s.points[i].first), py(s.points[i].second), px(s.points[i + 1].first),
               py(s.points[i + 1].second), color, 3);
    }
    for (const auto& [x, y] : s.points) img.rect(px(x) - 4, py(y) - 4, px(x) + 4, py(y) + 4, color);
    // Legend, top left inside the plot.
    const int ly = kTop + 12 + static_cast<int>(n) * 22;
    img.rect(kLeft + 14, ly, kLeft + 40, ly + 12, color);
    img.text(kLeft + 50, ly - 1, s.name, kInk, 2);
  }
  return img.write_png(path);
}

}  // namespace attncore_tools
