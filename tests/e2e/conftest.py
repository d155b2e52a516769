# The real S3 API on loopback (moto's server) for the loop through s3://.
from tests.integration.conftest import aws_env, bucket, moto_endpoint, s3_url  # noqa: F401
