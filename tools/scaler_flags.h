#pragma once
// The loss scaler's command-line options, declared once for every tool,
// with the defaults of the library's amp::GradScalerOptions, and checked
// with the scaler's own rule, the flag named ("mpt-train: --growth-factor
// must be ...").
#include <CLI/CLI.hpp>

#include <string>

#include "amp/grad_scaler.h"
#include "tools/cli_checks.h"

namespace mpt::tools {

// Which of them a tool offers.
struct ScalerFlagSet {
  bool growth_interval = true;  // false where the tool sets the intervals itself (a sweep)
  bool hysteresis = false;      // --hysteresis, --consecutive-hysteresis
  bool bounds = false;          // --min-scale, --max-scale
};

struct ScalerFlags {
  amp::GradScalerOptions options;       // the policy is the tool's to set
  double min_scale = 0, max_scale = 0;  // 0: none

  void add_to(CLI::App& app, ScalerFlagSet which = {}) {
    app.add_option("--init-scale", options.init_scale, "Loss scaler: initial scale")->capture_default_str()->check(positive());
    // The rest is checked with the scaler's own rule (checked()).
    app.add_option("--growth-factor", options.growth_factor, "Loss scaler: growth factor (above 1)")
        ->capture_default_str();
    app.add_option("--backoff-factor", options.backoff_factor, "Loss scaler: backoff factor (between 0 and 1)")
        ->capture_default_str();
    if (which.growth_interval)
      app.add_option("--growth-interval", options.growth_interval,
                     "Loss scaler: steps without overflow before growing")
          ->capture_default_str();
    if (which.hysteresis) {
      app.add_option("--hysteresis", options.hysteresis, "Loss scaler, hysteresis policy: overflows tolerated")
          ->capture_default_str();
      app.add_flag("--consecutive-hysteresis", options.consecutive_hysteresis,
                   "Loss scaler, hysteresis policy: a clean step restores the allowance");
    }
    if (which.bounds) {
      app.add_option("--min-scale", min_scale, "Loss scaler: floor of the scale (0: none)")->check(non_negative());
      app.add_option("--max-scale", max_scale, "Loss scaler: cap of the scale (0: none)")->check(non_negative());
    }
  }

  // The options with `policy`, refused (ValueError naming the flag, as
  // `owner` says it) where GradScaler would refuse them.
  amp::GradScalerOptions checked(amp::ScalePolicy policy, const std::string& owner) const {
    amp::GradScalerOptions o = options;
    o.policy = policy;
    if (min_scale > 0) o.min_scale = min_scale;
    if (max_scale > 0) o.max_scale = max_scale;
    amp::scale_rule_from(o, {owner, flag_for_field});
    return o;
  }
};

}  // namespace mpt::tools
