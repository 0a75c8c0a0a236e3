"""Run-folder primitives shared by the controller side and the worker: paths, state, heartbeats, tails."""
