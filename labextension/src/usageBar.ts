/**
 * The small usage bar of the panel: the track is the limit, a tick marks the
 * request (the guaranteed part), the fill is the usage, coloured differently
 * where it runs past the request (loaned memory).
 */
import { h, VirtualElement } from '@lumino/virtualdom';

export interface IBarFigures {
  usage?: number | null;
  request?: number | null;
  limit?: number | null;
}

function pct(x: number): string {
  return `${Math.max(0, Math.min(100, x * 100)).toFixed(1)}%`;
}

export function usageBar(figures: IBarFigures, className = ''): VirtualElement {
  const usage = Math.max(0, figures.usage ?? 0);
  const request = Math.max(0, figures.request ?? 0);
  const limit = Math.max(request, figures.limit ?? request);
  // Usage over the limit can happen for a moment before reclaim acts.
  const scale = Math.max(limit, usage, 1);
  const guaranteedFill = Math.min(usage, request) / scale;
  const loanedFill = Math.max(0, usage - request) / scale;
  const requestAt = pct(request / scale);

  return h.div(
    {
      className: `jp-gpufrac-Bar ${className}`.trim(),
      // The numbers are in the surrounding text; the bar is decoration.
      'aria-hidden': 'true'
    },
    // The guaranteed zone stays visible even while nothing is used.
    h.div({ className: 'jp-gpufrac-Bar-zone', style: { width: requestAt } }),
    h.div({
      className: 'jp-gpufrac-Bar-guaranteed',
      style: { width: pct(guaranteedFill) }
    }),
    loanedFill > 0
      ? h.div({
          className: 'jp-gpufrac-Bar-loaned',
          style: { left: requestAt, width: pct(loanedFill) }
        })
      : null,
    request > 0 && request < scale
      ? h.div({
          className: 'jp-gpufrac-Bar-request',
          style: { left: requestAt }
        })
      : null
  );
}
