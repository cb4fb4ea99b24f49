// The demo's two packed_bitmap rows alone (examples/demo.cpp), same workload and options.
#include <algorithm>
#include "demo_common.hpp"
int main(int argc, char** argv) {
  using namespace kvmosaic; using demo::workload;
  const demo::options o = demo::parse(argc, argv);
  const demo::workload w = demo::make_workload(o);
  std::vector<demo::row> rows;
  if (format::packed_bitmap packed; demo::mosaic(w.config, packed)) {
    cache<format::packed_bitmap> c(w.config, packed);
    rows.push_back(demo::run_host(c, w, o.steps));
    cache<format::packed_bitmap, select::mean_keys> selected(w.config, packed, demo::mean_keys_variants().front());
    rows.push_back(demo::run_host(selected, w, o.steps));
  }
  demo::print_table(rows, o);
  return 0;
}
std::vector<demo::row> demo::run_cuda(const workload&, int) { return {}; }
