"""The worker side: Celery's signals mapped to a child's start and terminal reports, and a successor's runs."""
