// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// kvmosaic, host part: every format, selector and compactor, the memory manager, the host backend
/// and the fp64 oracle. Compiles with a plain C++17 compiler and Eigen; no CUDA needed.
/// For the CUDA kernels include <kvmosaic/kvmosaic.cuh> instead (it includes this header).

#include "kvmosaic/core/config.hpp"
#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"
#include "kvmosaic/core/softmax_state.hpp"
#include "kvmosaic/core/view.hpp"

#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/format/dense.hpp"
#include "kvmosaic/format/bitmap_tiles.hpp"
#include "kvmosaic/format/quant.hpp"
#include "kvmosaic/format/packed_bitmap.hpp"

#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/all.hpp"
#include "kvmosaic/select/quest.hpp"
#include "kvmosaic/select/mean_keys.hpp"
#include "kvmosaic/select/sentence_chunks.hpp"
#include "kvmosaic/select/streaming.hpp"
#include "kvmosaic/select/token_scores.hpp"
#include "kvmosaic/select/scored_eviction.hpp"
#include "kvmosaic/select/tova.hpp"
#include "kvmosaic/select/h2o.hpp"
#include "kvmosaic/select/snapkv.hpp"
#include "kvmosaic/select/per_kv_head.hpp"

#include "kvmosaic/compact/compactor_traits.hpp"
#include "kvmosaic/compact/hole_fill.hpp"
#include "kvmosaic/compact/none.hpp"
#include "kvmosaic/compact/repack.hpp"

#include "kvmosaic/memory/page_pool.hpp"
#include "kvmosaic/memory/block_table.hpp"

#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/host/exact.hpp"

#include "kvmosaic/cache.hpp"
#include "kvmosaic/per_kv_head_cache.hpp"
#include "kvmosaic/model_cache.hpp"
