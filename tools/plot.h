// Line charts as PNG files, for `attncore bench --png`.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace attncore_tools {

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), x > 0 ascending
};

struct LineChart {
  std::string title, x_label, y_label;  // printable: digits, letters, " ./-=%():,_"
  std::vector<Series> series;
};

// Draws the chart (log2 x axis, linear y axis from 0) into a 960x600 PNG; false on failure.
bool write_line_chart(const LineChart& chart, const std::string& path);

}  // namespace attncore_tools
