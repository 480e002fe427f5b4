// Umbrella header: everything a training program needs.
#pragma once

#include "diststrat/checkpoint.h"
#include "diststrat/collective.h"
#include "diststrat/config.h"
#include "diststrat/data.h"
#include "diststrat/device.h"
#include "diststrat/dtype.h"
#include "diststrat/error.h"
#include "diststrat/io.h"
#include "diststrat/logging.h"
#include "diststrat/mirrored.h"
#include "diststrat/nn.h"
#include "diststrat/optimizer.h"
#include "diststrat/strategy.h"
#include "diststrat/tensor.h"
#include "diststrat/variable.h"
