#!/usr/bin/env bash
# engine_server_kill against real SGLang 0.5.23 on CPU (greedy, cold restart: no standby), EXPECT=survival.
# No standby, so the recovery is a restart, not a handover; 256-token turns killed at token 8, so the kill
# lands while SGLang still has tokens to produce (its stream runs behind its decoding: a 48-token turn
# could finish before a kill at token 8 landed, and the check then rightly failed).
here=$(dirname "$0")
EXPECT=survival GOLDEN_TAG=sglang exec "$here/run_scenario.sh" chaos/engine_server_kill $(cat "$here/sglang.overrides") \
  belayer.chaos.at=8 "belayer.chaos.expect=[engine_detected,engine_replaced,request_resumed_midway]" "$@"
