from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_unique", "0004_uniquekey_follow_duplicates"),
    ]

    operations = [
        migrations.AddField(
            model_name="uniquekey",
            name="alive_until",
            field=models.BigIntegerField(
                blank=True,
                help_text="Until when the running delivery is vouched alive by its worker.",
                null=True,
            ),
        ),
    ]
