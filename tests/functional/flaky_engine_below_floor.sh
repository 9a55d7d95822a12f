#!/usr/bin/env bash
# Chaos scenario: flaky_engine_below_floor. An engine that dies after every restart, with a floor of 2 engines: retired, then a typed failure, fast.
EXPECT=bounded_failure ERROR_TYPE=FleetBelowFloorError MAX_DURATION=240 exec "$(dirname "$0")/run_scenario.sh" chaos/flaky_engine_below_floor "$@"
