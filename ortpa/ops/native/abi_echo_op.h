#pragma once

#include "custom_op.h"

namespace ortpa::native {

// ortpa.test::AbiEcho (abi_echo_op.cc)
OpDef& AbiEchoOp();

}  // namespace ortpa::native
