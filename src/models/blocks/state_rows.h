// Rows [first, first + rows) of a micro-batch that belong to one sequence, and the part of
// that sequence's state a block advances over them (its conv and delta-rule state, its QSA key
// tables, its PLE context). A block's per-sequence ops run once per run; everything row-wise
// runs over every row of the micro-batch at once (models/model.h: SequenceRun).
#pragma once

#include <cstdint>

namespace turbospark {

template <typename State>
struct StateRows {
  int64_t first = 0, rows = 0;
  State* state = nullptr;
};

}  // namespace turbospark
