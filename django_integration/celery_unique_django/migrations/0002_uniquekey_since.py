from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_unique", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="uniquekey",
            name="since",
            field=models.BigIntegerField(
                blank=True,
                help_text=(
                    "When a decision wrote the key: epoch milliseconds on the database's clock."
                ),
                null=True,
            ),
        ),
    ]
