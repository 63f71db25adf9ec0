// Run reports: the loss curves of a run as an SVG plot, from its metrics.jsonl.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace lt {

// A number from metrics.jsonl or checkpoint metadata: NaN for null (JSON has no NaN: a non-finite
// value is written as null) or for anything else that is not a number.
double metric_value(const nlohmann::json& v);

// Every event line of a run's metrics.jsonl (missing file: empty).
std::vector<nlohmann::json> read_metrics(const std::string& run_dir);

struct PlotMarker {
  int64_t step;
  std::string label;
};

// Writes an SVG of the training loss and of each dataset's validation loss against the step, with a
// dashed vertical line per marker (phase or stage boundaries). Written atomically.
void write_loss_plot(const std::vector<nlohmann::json>& metrics, const std::vector<PlotMarker>& markers,
                     const std::string& title, const std::string& path);

// Writes an SVG heat map of the forgetting matrix: one row per finished stage ({"after_stage",
// "loss": {dataset: nats}}), one column per dataset, each cell coloured by and labelled with its loss.
void write_matrix_plot(const nlohmann::json& rows, const std::string& title, const std::string& path);

}  // namespace lt
