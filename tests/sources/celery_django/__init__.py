"""A Django project whose Celery app keeps its results with django-celery-results
(``result_backend = "django-db"``): the celery source's second result table."""
