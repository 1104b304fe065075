"""What a run tells its user beyond the report's data: ``explain`` (why a rule fired or not,
the levers), ``lint`` (problems of a model as given) and the HTML report (``report_html``).

May import: ``opt.verify`` and every package below it.
"""
