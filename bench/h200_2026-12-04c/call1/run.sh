#!/bin/bash
# Session 33 call 1 ran session 32's prepared script as it is:
bash bench/h200_2026-12-04b/next.sh
