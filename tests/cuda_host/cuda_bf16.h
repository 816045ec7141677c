// stands in for CUDA's cuda_bf16.h on the CPU: __half and __nv_bfloat16 are in cuda_host.h
#pragma once
#include "cuda_host.h"
