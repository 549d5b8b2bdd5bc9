-- wrk script: POST the AdmissionReviews named in BODY_FILES (colon-separated) in rotation, as the apiserver does.
-- Prints one machine-readable line: RESULT requests duration_us p50_us p99_us non2xx socket_errors
local requests = {}
local next_index = 1

function init(args)
  local path = os.getenv("BENCH_PATH") or "/mutate?timeout=10s"
  for file in string.gmatch(os.getenv("BODY_FILES"), "[^:]+") do
    local f = assert(io.open(file, "rb"))
    local body = f:read("*a")
    f:close()
    table.insert(requests, wrk.format("POST", path, {["Content-Type"] = "application/json"}, body))
  end
  next_index = math.random(#requests)
end

function request()
  local r = requests[next_index]
  next_index = next_index % #requests + 1
  return r
end

function done(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format("RESULT %d %d %.1f %.1f %d %d\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), errors.status,
    errors.connect + errors.read + errors.write + errors.timeout))
end
