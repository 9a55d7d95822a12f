#!/usr/bin/env bash
# Chaos scenario: learner_kill. SIGKILL the learner before step 2's update: a new learner resumes from step 1's checkpoint and re-runs it.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/learner_kill "$@"
