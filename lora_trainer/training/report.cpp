#include "lora_trainer/training/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

double metric_value(const nlohmann::json& v) { return v.is_number() ? v.get<double>() : std::nan(""); }

std::vector<nlohmann::json> read_metrics(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::string path = (std::filesystem::path(run_dir) / "metrics.jsonl").string();
  if (!std::filesystem::exists(path)) return out;
  std::istringstream in(read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j;
    try {
      j = parse_json(line, path);
    } catch (const UserError&) {
      continue;  // a line cut short by a kill
    }
    if (j.is_object()) out.push_back(j);
  }
  return out;
}

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else o += c;
  }
  return o;
}

// A "nice" tick step for a range (1, 2 or 5 times a power of ten).
double tick_step(double range, int target) {
  double raw = range / std::max(1, target);
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

std::string fmt(double v) {
  char b[32];
  if (std::fabs(v) >= 1000) std::snprintf(b, sizeof b, "%.0f", v);
  else std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

}  // namespace

void write_loss_plot(const std::vector<nlohmann::json>& metrics, const std::vector<PlotMarker>& markers,
                     const std::string& title, const std::string& path) {
  using Series = std::vector<std::pair<double, double>>;
  Series train;
  std::map<std::string, Series> val;
  for (const auto& e : metrics) {
    std::string ev = e.value("event", std::string());
    double step = e.value("step", 0.0);
    // Non-finite values (null in the file) are gaps in the curve.
    if (ev == "train" && e.contains("loss") && std::isfinite(metric_value(e["loss"])))
      train.emplace_back(step, metric_value(e["loss"]));
    if (ev == "val" && e.contains("per_dataset") && e["per_dataset"].is_object())
      for (auto& [name, loss] : e["per_dataset"].items())
        if (std::isfinite(metric_value(loss))) val[name].emplace_back(step, metric_value(loss));
  }
  double x_max = 1, y_min = 1e30, y_max = -1e30;
  auto scan = [&](const Series& s) {
    for (auto& [x, y] : s) {
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
    }
  };
  scan(train);
  for (auto& [n, s] : val) scan(s);
  if (y_min > y_max) y_min = 0, y_max = 1;
  double pad = std::max(0.05, (y_max - y_min) * 0.05);
  y_min = std::max(0.0, y_min - pad);
  y_max += pad;

  const double W = 900, H = 520, L = 70, R = 190, Tm = 40, B = 50;
  auto X = [&](double x) { return L + (W - L - R) * x / x_max; };
  auto Y = [&](double y) { return Tm + (H - Tm - B) * (1 - (y - y_min) / (y_max - y_min)); };
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << esc(title) << "</text>\n";
  double ys = tick_step(y_max - y_min, 6);
  for (double y = std::ceil(y_min / ys) * ys; y <= y_max + 1e-9; y += ys)
    svg << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << Y(y) << "\" y2=\"" << Y(y)
        << "\" stroke=\"#e5e5e5\"/><text x=\"" << L - 6 << "\" y=\"" << Y(y) + 4 << "\" text-anchor=\"end\">" << fmt(y)
        << "</text>\n";
  double xs = tick_step(x_max, 8);
  for (double x = 0; x <= x_max + 1e-9; x += xs)
    svg << "<line x1=\"" << X(x) << "\" x2=\"" << X(x) << "\" y1=\"" << H - B << "\" y2=\"" << H - B + 5
        << "\" stroke=\"black\"/><text x=\"" << X(x) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">"
        << fmt(x) << "</text>\n";
  svg << "<rect x=\"" << L << "\" y=\"" << Tm << "\" width=\"" << W - L - R << "\" height=\"" << H - Tm - B
      << "\" fill=\"none\" stroke=\"black\"/>\n";
  svg << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">step</text>\n";
  svg << "<text transform=\"translate(18," << (Tm + H - B) / 2
      << ") rotate(-90)\" text-anchor=\"middle\">loss (nats per token)</text>\n";
  for (const auto& m : markers) {
    svg << "<line x1=\"" << X(m.step) << "\" x2=\"" << X(m.step) << "\" y1=\"" << Tm << "\" y2=\"" << H - B
        << "\" stroke=\"#555\" stroke-dasharray=\"6,4\"/><text x=\"" << X(m.step) + 4 << "\" y=\"" << Tm + 14
        << "\" fill=\"#555\">" << esc(m.label) << "</text>\n";
  }
  static const char* colors[] = {"#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};
  auto polyline = [&](const Series& s, const std::string& color, double width) {
    svg << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"" << width << "\" points=\"";
    for (auto& [x, y] : s) svg << X(x) << "," << Y(y) << " ";
    svg << "\"/>\n";
  };
  double ly = Tm + 10;
  auto legend = [&](const std::string& label, const std::string& color) {
    svg << "<line x1=\"" << W - R + 15 << "\" x2=\"" << W - R + 40 << "\" y1=\"" << ly << "\" y2=\"" << ly
        << "\" stroke=\"" << color << "\" stroke-width=\"2.5\"/><text x=\"" << W - R + 46 << "\" y=\"" << ly + 4
        << "\">" << esc(label) << "</text>\n";
    ly += 20;
  };
  polyline(train, "#1f77b4", 1.5);
  legend("train", "#1f77b4");
  size_t c = 0;
  for (auto& [name, s] : val) {
    std::string color = colors[c++ % 7];
    polyline(s, color, 2.0);
    for (auto& [x, y] : s) svg << "<circle cx=\"" << X(x) << "\" cy=\"" << Y(y) << "\" r=\"3\" fill=\"" << color << "\"/>\n";
    legend("validation: " + name, color);
  }
  svg << "</svg>\n";
  write_file_atomic(path, svg.str());
}

void write_matrix_plot(const nlohmann::json& rows, const std::string& title, const std::string& path) {
  std::vector<std::string> cols;
  double lo = 1e30, hi = -1e30;
  for (const auto& row : rows)
    for (auto& [name, loss] : row["loss"].items()) {
      if (std::find(cols.begin(), cols.end(), name) == cols.end()) cols.push_back(name);
      if (!std::isfinite(metric_value(loss))) continue;
      lo = std::min(lo, metric_value(loss));
      hi = std::max(hi, metric_value(loss));
    }
  const double cw = 120, ch = 36, L = 170, Tm = 70;
  // Wide enough for the caption whatever the number of columns.
  const double W = std::max(L + cw * std::max<size_t>(1, cols.size()) + 30, 640.0);
  const double H = Tm + ch * std::max<size_t>(1, rows.size()) + 40;
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << esc(title) << "</text>\n";
  svg << "<text x=\"" << W / 2 << "\" y=\"" << Tm - 30
      << "\" text-anchor=\"middle\">dataset evaluated (held-out loss, nats per token; darker = higher)</text>\n";
  for (size_t c = 0; c < cols.size(); ++c)
    svg << "<text x=\"" << L + cw * (c + 0.5) << "\" y=\"" << Tm - 8 << "\" text-anchor=\"middle\">" << esc(cols[c])
        << "</text>\n";
  for (size_t r = 0; r < rows.size(); ++r) {
    svg << "<text x=\"" << L - 8 << "\" y=\"" << Tm + ch * (r + 0.5) + 4 << "\" text-anchor=\"end\">after stage "
        << rows[r]["after_stage"].get<int>() << "</text>\n";
    for (size_t c = 0; c < cols.size(); ++c) {
      if (!rows[r]["loss"].contains(cols[c])) continue;
      double v = metric_value(rows[r]["loss"][cols[c]]);
      double t = !std::isfinite(v) ? 1.0 : hi > lo ? (v - lo) / (hi - lo) : 0.5;
      int shade = static_cast<int>(235 - 160 * t);
      svg << "<rect x=\"" << L + cw * c << "\" y=\"" << Tm + ch * r << "\" width=\"" << cw << "\" height=\"" << ch
          << "\" fill=\"rgb(" << shade << "," << shade << ",255)\" stroke=\"white\"/><text x=\"" << L + cw * (c + 0.5)
          << "\" y=\"" << Tm + ch * (r + 0.5) + 4 << "\" text-anchor=\"middle\">" << fmt(v) << "</text>\n";
    }
  }
  svg << "</svg>\n";
  write_file_atomic(path, svg.str());
}

}  // namespace lt
