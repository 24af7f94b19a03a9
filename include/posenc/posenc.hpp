// posenc/posenc.hpp — everything public in one include.
#pragma once

#include "posenc/absolute.hpp"
#include "posenc/attention.hpp"
#include "posenc/bias.hpp"
#include "posenc/dtype.hpp"
#include "posenc/error.hpp"
#include "posenc/floater.hpp"
#include "posenc/memory.hpp"
#include "posenc/positions.hpp"
#include "posenc/reference.hpp"
#include "posenc/registry.hpp"
#include "posenc/relative.hpp"
#include "posenc/rotary.hpp"
#include "posenc/runtime.hpp"
#include "posenc/scheme.hpp"
#include "posenc/tensor.hpp"
