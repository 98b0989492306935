"""Tests of rlengine/analysis: accounting, fits, roofline, memory."""
