# The gateway only (its two packages: gateway/ and policies/; the simulator and the load
# tests stay out of the image, and the gateway imports neither): slim base, non-root
# user, health check.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin gateway
COPY --from=build /install /usr/local
COPY config/gateway.yaml /etc/gateway/gateway.yaml
USER gateway
EXPOSE 30000
# The gateway's own liveness: 200 while the process serves, whatever the workers' state.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=2)" || exit 1
ENTRYPOINT ["python", "-m", "gateway"]
# Inside the container the gateway must listen on all interfaces to be reachable through -p.
CMD ["--config", "/etc/gateway/gateway.yaml", "--host", "0.0.0.0"]
