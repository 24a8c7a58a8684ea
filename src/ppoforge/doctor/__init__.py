"""`ppoforge doctor`: can this machine run ppoforge, and if not, exactly what to change.

One check = one small function returning `report.CheckResult(name, status, evidence, fix)`; facts are
gathered by separate `gather_*` functions so tests can hand a check any machine. `runner.run_doctor`
runs them in order and `report.verdicts` turns them into one verdict per capability.
"""
