// attncore._core's KV-cache part: attention over a dense or paged cache (with appends),
// merge_attention_states, and the PagedKvCache class (attncore.PagedKVCache's storage).
#pragma once

#include <pybind11/pybind11.h>

namespace attncore_python {

// Adds forward_kvcache, merge_attention_states and PagedKvCache to the module.
void bind_kvcache(pybind11::module_& m);

}  // namespace attncore_python
