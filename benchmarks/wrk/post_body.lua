-- wrk script for benchmarks/serve_oip.py: POST one fixed request body, read from a file, on every request.
--
--   wrk -t2 -c8 -d10s --latency -s benchmarks/wrk/post_body.lua http://127.0.0.1:8000/v2/models/m/infer \
--       -- BODY_FILE CONTENT_TYPE [HEADER_NAME HEADER_VALUE]...
--
-- The request is formatted once per thread (no request() function, so wrk reuses it). done() prints one
-- line, "wrk-json {...}": requests, duration, errors and latency percentiles in microseconds, which
-- serve_oip.py reads beside wrk's own --latency table.

function init(args)
   local f = assert(io.open(args[1], "rb"))
   wrk.body = f:read("*all")
   f:close()
   wrk.method = "POST"
   wrk.headers["Content-Type"] = args[2]
   local i = 3
   while args[i] and args[i + 1] do
      wrk.headers[args[i]] = args[i + 1]
      i = i + 2
   end
end

function done(summary, latency, requests)
   local e = summary.errors
   local ps = {}
   for _, p in ipairs({50, 75, 90, 95, 99, 99.9}) do
      ps[#ps + 1] = string.format('"%s": %d', tostring(p), latency:percentile(p))
   end
   io.write(string.format(
      'wrk-json {"requests": %d, "duration_us": %d, "bytes": %d, "errors": {"connect": %d, "read": %d, ' ..
      '"write": %d, "status": %d, "timeout": %d}, "latency_us": {"mean": %.1f, "stdev": %.1f, "min": %d, ' ..
      '"max": %d, "percentiles": {%s}}}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
      latency.mean, latency.stdev, latency.min, latency.max, table.concat(ps, ", ")))
end
